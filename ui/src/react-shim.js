// The host's React (Airflow's UI sets globalThis.React before it loads plugins): JSX compiles to React.createElement.
export const React = globalThis.React;
