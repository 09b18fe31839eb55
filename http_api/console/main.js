// The console's pages (#chat, #live) and its API key: without a key the server accepts, no page shows data.

import { apiKey, getJSON, setApiKey, Unauthorized } from "./api.js";
import { Chat } from "./chat.js";
import { Live } from "./live.js";

const $ = (id) => document.getElementById(id);
const PAGES = ["chat", "live"];

const chat = new Chat();
const live = new Live(failed);
let authorized = false;

// Asks the server whether the key (or none) is accepted; shows the pages or the key notice.
async function authorize() {
  $("unreachable").hidden = true;
  try {
    authorized = (await getJSON("/console/auth")).authorized;
    if (authorized) await chat.loadModels();
  } catch (e) {
    authorized = false;
    if (!(e instanceof Unauthorized)) {
      $("unreachable-error").textContent = e.message;
      $("unreachable").hidden = false;
    }
  }
  $("key-needed").hidden = authorized || !$("unreachable").hidden;
  $("key-error").textContent = !authorized && apiKey() ? "The server refused this key." : "";
  if (!authorized) live.stop();
  route();
}

function failed(e) {
  if (e instanceof Unauthorized) authorize();
}

function route() {
  const page = PAGES.includes(location.hash.slice(1)) ? location.hash.slice(1) : "chat";
  for (const p of PAGES) {
    $(p).hidden = !authorized || p !== page;
    $(`tab-${p}`).classList.toggle("active", p === page);
  }
  if (authorized && page === "live") live.start();
  else live.stop();
}

$("key-form").addEventListener("submit", (e) => {
  e.preventDefault();
  setApiKey($("api-key").value.trim());
  authorize();
});
$("api-key").value = apiKey();
window.addEventListener("hashchange", route);
authorize();
