// The demo page: a fake shop whose state is sent as keyed page context with every message.
(async function () {
  "use strict";
  const state = { route: "/products", selection: "nothing", cart: 0 };
  const $ = (id) => document.getElementById(id);

  function show() {
    $("route").textContent = "route: " + state.route;
    $("cart").textContent = "cart: " + state.cart + (state.cart === 1 ? " item" : " items");
    $("title").textContent = state.selection === "nothing" ? "Pick a lamp" : state.selection;
    $("add").disabled = state.selection === "nothing";
    document.querySelectorAll(".product").forEach((b) => {
      b.setAttribute("aria-pressed", String(b.dataset.name === state.selection));
    });
  }
  document.querySelectorAll(".product").forEach((b, n) => {
    b.addEventListener("click", () => {
      state.selection = b.dataset.name;
      state.route = "/products/" + (n + 1);
      show();
    });
  });
  $("add").addEventListener("click", () => {
    state.cart += 1;
    show();
  });
  $("new").addEventListener("click", () => {
    localStorage.removeItem("keel-demo-session");
    location.reload();
  });
  show();

  async function post(path) {
    const r = await fetch(path, { method: "POST", headers: { "content-type": "application/json" }, body: "{}" });
    if (!r.ok) throw new Error(path + ": " + r.status);
    return r.json();
  }
  let session = localStorage.getItem("keel-demo-session");
  if (session && (await fetch("/v1/sessions/" + session)).status === 404) session = null; // data wiped
  if (!session) {
    session = (await post("/v1/sessions")).session_id;
    localStorage.setItem("keel-demo-session", session);
  }
  window.keelDemo = { session: session, state: state };
  Keel.mount($("assistant"), {
    url: location.origin,
    session: session,
    title: "Acme assistant",
    token: async () => (await post("/v1/sessions/" + session + "/tokens")).token,
    context: () => ({ route: state.route, selection: state.selection, cart: String(state.cart) }),
  });
})();
