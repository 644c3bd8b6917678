// Airflow's UI import()s this bundle and renders globalThis[<react app name>] (see the plugin's react_apps).
import JobsPage from "./JobsPage";
import JobTab from "./JobTab";

globalThis["Training jobs"] = JobsPage;
globalThis["Training job"] = JobTab;
