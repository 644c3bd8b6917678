// The plugin's JSON API, on the api-server's origin. The UI's `_token` cookie authenticates the requests.
const base = () => new URL("torch-elastic/api/", document.baseURI);

export async function getJson(path, params = {}) {
  const url = new URL(path, base());
  for (const [key, value] of Object.entries(params)) {
    if (value !== undefined && value !== null && value !== "") url.searchParams.set(key, String(value));
  }
  const answer = await fetch(url, { credentials: "same-origin", headers: { Accept: "application/json" } });
  if (!answer.ok) {
    let detail = answer.statusText;
    try {
      detail = (await answer.json()).detail ?? detail;
    } catch (_) {
      /* not JSON: keep the status text */
    }
    throw new Error(`HTTP ${answer.status}: ${detail}`);
  }
  return answer.json();
}

export const isActive = (phase) => phase === "pending" || phase === "running";
