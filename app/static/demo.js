// The demo page: a fake shop whose state is sent as keyed page context with every message.
// Its own state outlives a reload: the selected lamp is in the URL (#/products/2) and, with
// the cart, in localStorage. An order the agent placed (a place_order the person approved)
// goes into the cart: the panel tells the page of each event, and the page counts each order
// once (a reload replays the conversation's events). The panel's conversations menu lists the
// sessions (the demo has no API key, so the panel may ask keel itself); the one shown is kept
// in localStorage, to show it again after a reload.
(async function () {
  "use strict";
  const $ = (id) => document.getElementById(id);
  const products = [...document.querySelectorAll(".product")];
  const KEY = "keel-demo-page";
  const state = Object.assign({ index: -1, added: 0, orders: [] }, stored());
  const page = {
    get route() {
      return state.index < 0 ? "/products" : "/products/" + (state.index + 1);
    },
    get selection() {
      return state.index < 0 ? "nothing" : products[state.index].dataset.name;
    },
    get cart() {
      return state.added + state.orders.length;
    },
  };

  function stored() {
    try {
      const saved = JSON.parse(localStorage.getItem(KEY) || "{}");
      const fine = Number.isInteger(saved.index) && saved.index < products.length;
      return fine && Number.isInteger(saved.added) && Array.isArray(saved.orders) ? saved : {};
    } catch (err) {
      return {}; // unreadable: start afresh
    }
  }

  function fromUrl() {
    // "#/products/2" -> 1; "#/products" -> -1; anything else: the URL says nothing
    const m = /^#\/products(?:\/(\d+))?$/.exec(location.hash);
    if (!m) return null;
    const n = m[1] ? Number(m[1]) - 1 : -1;
    return n < products.length ? n : null;
  }

  function show() {
    $("route").textContent = "route: " + page.route;
    $("cart").textContent = "cart: " + page.cart + (page.cart === 1 ? " item" : " items");
    $("title").textContent = page.selection === "nothing" ? "Pick a lamp" : page.selection;
    $("add").disabled = state.index < 0;
    products.forEach((b, n) => b.setAttribute("aria-pressed", String(n === state.index)));
    localStorage.setItem(KEY, JSON.stringify(state));
    if (location.hash !== "#" + page.route) history.replaceState(null, "", "#" + page.route);
  }

  const linked = fromUrl();
  if (linked !== null) state.index = linked; // a link to a lamp wins over what was stored
  products.forEach((b, n) => {
    b.addEventListener("click", () => {
      state.index = n;
      show();
    });
  });
  window.addEventListener("hashchange", () => {
    const n = fromUrl();
    if (n !== null) state.index = n;
    show();
  });
  $("add").addEventListener("click", () => {
    state.added += 1;
    show();
  });
  show();

  function followed(event) {
    const d = event.data || {};
    if (event.type !== "tool.completed" || d.tool !== "place_order" || d.is_error) return;
    if (state.orders.includes(d.call_id)) return; // counted already (before a reload)
    state.orders.push(d.call_id);
    show();
  }

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
  window.keelDemo = { session: session, state: page };
  Keel.mount($("assistant"), {
    url: location.origin,
    session: session,
    title: "Acme assistant",
    token: async (sid) => (await post("/v1/sessions/" + sid + "/tokens")).token,
    context: () => ({ route: page.route, selection: page.selection, cart: String(page.cart) }),
    question: (r) => (r.tool === "place_order" && r.arguments.item ? "Order the " + r.arguments.item + "?" : null),
    onEvent: followed,
    conversations: true,
    onSwitch: (sid) => {
      window.keelDemo.session = sid;
      localStorage.setItem("keel-demo-session", sid);
    },
  });
})();
