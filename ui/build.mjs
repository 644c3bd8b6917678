// Builds the plugin's bundle into the Python package (airflow_provider_torchelastic/plugin/static), where the
// plugin's FastAPI app serves it. Airflow's UI loads it with a dynamic import() and then looks the components up
// by the react app's name on globalThis; React comes from the host page (globalThis.React), never bundled, so the
// pages share the UI's React and nothing is fetched from a CDN.
import { build } from "esbuild";
import { copyFileSync, mkdirSync } from "node:fs";

const out = new URL("../airflow_provider_torchelastic/plugin/static/", import.meta.url).pathname;
mkdirSync(out, { recursive: true });
await build({
  entryPoints: ["src/index.jsx"],
  outfile: `${out}torch-elastic.js`,
  bundle: true,
  // An IIFE is also a valid module body: it runs once when the UI import()s it.
  format: "iife",
  target: "es2020",
  jsx: "transform",
  jsxFactory: "React.createElement",
  jsxFragment: "React.Fragment",
  inject: ["src/react-shim.js"],
  minify: true,
  sourcemap: false,
  legalComments: "none",
  logLevel: "warning",
});
copyFileSync("src/icon.svg", `${out}icon.svg`);
console.log(`built ${out}torch-elastic.js`);
