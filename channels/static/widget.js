/* keel's embeddable assistant panel. No build step, no framework.

   <script src="https://your-keel/widget.js"></script>
   <script>
     Keel.mount(document.getElementById("assistant"), {
       url: "https://your-keel",          // keel's base URL (default: this page's origin)
       session: "ses_...",                 // the session to show
       token: async (session) => fetchTokenFromYourBackend(session),  // or a string; re-asked on reconnect
       context: () => ({ route: location.pathname, selection: currentSelection() }),
       question: (request) => null,        // optional: an approval's question in your words
       onEvent: (event) => {},             // optional: each committed event, once (see below)
       conversations: true,                // optional: the conversations menu (see below)
       onSwitch: (session) => {},          // optional: the person switched the panel to this session
     });
   </script>

   Every message carries the page context `context()` returns at that moment. The panel shows
   the conversation as events arrive (deltas, tool activity, approval requests with Approve and
   Deny), reconnects by itself after `after=<last event id>`, never shows an event twice, and
   resends a message the server has not acknowledged with the same message_id (so it is one
   message, whatever happened to the connection). All text is set with textContent.

   An approval card asks in words what will happen, the call's arguments below it: the
   question is `question({request_id, tool, arguments})` when that returns a string, else one
   made from the tool's name and its one argument ("Place order: Green lamp?"). `onEvent` gets
   every committed event the panel shows (`{id, type, data}`; a reloaded page gets the
   conversation's events again: tell them apart by their ids), so the page can follow what the
   agent did, e.g. `tool.completed`.

   `conversations` puts a menu button in the panel's head: "New conversation", then the
   person's conversations, most recent first (their titles; the one shown is checked); choosing
   one shows it (its events from the first), and messages then go to it. `true` has the panel
   call keel's API at `url` itself, with no key: only keel's keyless local mode (the demo page)
   lets a page list sessions. With API keys, pass `{list: async () => [{session_id, title}],
   create: async () => "ses_..."}` instead, backed by your backend's `GET /v1/sessions` and
   `POST /v1/sessions`. "New conversation" on a conversation nothing was said in stays there.
   `onSwitch(session)` tells the page which session is shown now (to show it again after a
   reload); `token(session)` is asked for a token for that session. A message the server has
   not acknowledged when the person switches away is sent when its conversation shows again. */
(function () {
  "use strict";

  // keel's event types by name, from its catalogue (harness/events.py): filled in when served
  const EV = /* keel: events */ {};

  const STYLE = `
.keel-panel{font:14px/1.4 system-ui,sans-serif;display:flex;flex-direction:column;height:100%;
  border:1px solid #d0d4da;border-radius:8px;background:#fff;color:#1d232b;overflow:hidden;position:relative}
.keel-panel *,.keel-panel *::before,.keel-panel *::after{box-sizing:border-box}
.keel-head{padding:8px 12px;background:#1d232b;color:#fff;font-weight:600;display:flex;align-items:center;gap:8px}
.keel-title{min-width:0;overflow:hidden;text-overflow:ellipsis;white-space:nowrap}
.keel-status{margin-left:auto;font-weight:400;opacity:.8;white-space:nowrap}
.keel-menu-button{border:0;border-radius:4px;background:none;color:inherit;font:inherit;line-height:1;
  padding:2px 6px;margin-left:-6px;cursor:pointer}
.keel-menu-button:hover,.keel-menu-button[aria-expanded=true]{background:#ffffff26}
.keel-menu{position:absolute;left:8px;z-index:1;width:min(280px,calc(100% - 16px));max-height:min(320px,70%);
  overflow-y:auto;padding:4px;background:#fff;border:1px solid #d0d4da;border-radius:8px;
  box-shadow:0 4px 16px #1d232b26}
.keel-item{display:block;width:100%;position:relative;padding:6px 8px 6px 24px;border:0;border-radius:6px;
  background:none;color:inherit;font:inherit;text-align:left;cursor:pointer;white-space:nowrap;overflow:hidden;
  text-overflow:ellipsis}
.keel-item:hover,.keel-item:focus{background:#eef0f3;outline:none}
.keel-item:focus-visible{outline:2px solid #2f6fed;outline-offset:-2px}
.keel-item[aria-checked=true]{font-weight:600}
.keel-item[aria-checked=true]::before{content:"✓";position:absolute;left:8px}
.keel-menu hr{margin:4px 0;border:0;border-top:1px solid #d0d4da}
.keel-menu-note{padding:6px 8px 6px 24px;font-size:12px;color:#6b7380}
.keel-log{flex:1;overflow-y:auto;padding:10px;display:flex;flex-direction:column;gap:6px}
.keel-msg{padding:6px 10px;border-radius:10px;max-width:85%;white-space:pre-wrap;overflow-wrap:anywhere}
.keel-user{align-self:flex-end;background:#2f6fed;color:#fff}
.keel-assistant{align-self:flex-start;background:#eef0f3}
.keel-tool{align-self:flex-start;max-width:100%;font-size:12px;color:#4a5563;font-family:ui-monospace,monospace;
  overflow-wrap:anywhere}
.keel-note{align-self:center;font-size:12px;color:#6b7380}
.keel-error{align-self:stretch;font-size:12px;color:#a12121;background:#fdecec;padding:4px 8px;border-radius:6px}
.keel-approval{align-self:stretch;border:1px solid #e0b84a;background:#fff8e6;border-radius:8px;padding:8px;
  display:flex;flex-direction:column;gap:6px;overflow-wrap:anywhere}
.keel-question{font-weight:600}
.keel-args{margin:0;font-size:12px;color:#4a5563;display:grid;grid-template-columns:auto minmax(0,1fr);gap:2px 8px}
.keel-args dt{font-family:ui-monospace,monospace}
.keel-args dd{margin:0;white-space:pre-wrap}
.keel-call{font-size:12px;color:#4a5563;font-family:ui-monospace,monospace}
.keel-actions{display:flex;flex-wrap:wrap;gap:6px}
.keel-thinking{align-self:flex-start;color:#6b7380;font-style:italic}
.keel-form{display:flex;border-top:1px solid #d0d4da}
.keel-input{flex:1;min-width:0;border:0;padding:10px;font:inherit;outline:none}
.keel-send{border:0;background:#2f6fed;color:#fff;padding:0 16px;font:inherit;cursor:pointer}
@media (max-width:480px){.keel-input{font-size:16px}}`; /* (16 px: a phone does not zoom into it) */

  function el(tag, cls, text) {
    const node = document.createElement(tag);
    if (cls) node.className = cls;
    if (text !== undefined) node.textContent = text;
    return node;
  }

  // "place_order" (or "placeOrder") -> "Place order"
  function words(name) {
    const said = String(name).replace(/([a-z0-9])([A-Z])/g, "$1 $2").replace(/[_\-.\s]+/g, " ").trim().toLowerCase();
    return said.charAt(0).toUpperCase() + said.slice(1);
  }

  function shown(value) {
    return typeof value === "string" ? value : JSON.stringify(value);
  }

  // An approval's question when the page gives none: the tool's name in words, with its
  // argument when it has one that reads as a word or a number ("Place order: Green lamp?")
  function question(r) {
    const values = Object.values(r.arguments || {});
    const one = values.length === 1 && (values[0] === null || typeof values[0] !== "object");
    return words(r.tool) + (one ? ": " + shown(values[0]) : "") + "?";
  }

  function newId() {
    if (window.crypto && crypto.randomUUID) return "w-" + crypto.randomUUID();
    return "w-" + Date.now().toString(36) + Math.random().toString(36).slice(2);
  }

  // The conversations of keel's API at `url`, asked with no key (keel's keyless local mode)
  function keelConversations(url) {
    const base = url.replace(/\/$/, "") + "/v1/sessions";
    async function call(path, init) {
      const r = await fetch(base + path, init);
      if (!r.ok) throw new Error(base + path + ": " + r.status);
      return r.json();
    }
    return {
      list: async () => (await call("?limit=20")).items,
      create: async () => {
        const made = await call("", { method: "POST", headers: { "content-type": "application/json" }, body: "{}" });
        return made.session_id;
      },
    };
  }

  // The conversations menu: a button that opens "New conversation", then what `source.list()`
  // gives, the one `showing()` checked. `choose(session)` shows a session; `fresh(untitled)`
  // starts one, told whether the one showing is untitled (nothing was said in it). A menu
  // button as ARIA has it: the arrow keys, Home and End move in the menu, Escape closes it
  // (back to the button), and so do Tab and a click elsewhere.
  function conversationsMenu(panel, head, source, showing, choose, fresh) {
    const button = el("button", "keel-menu-button", "☰");
    button.type = "button";
    button.title = "Conversations";
    button.setAttribute("aria-label", "Conversations");
    button.setAttribute("aria-haspopup", "menu");
    button.setAttribute("aria-expanded", "false");
    const menu = el("div", "keel-menu");
    menu.id = newId();
    menu.hidden = true;
    menu.setAttribute("role", "menu");
    menu.setAttribute("aria-label", "Conversations");
    button.setAttribute("aria-controls", menu.id);
    panel.appendChild(menu);
    let opening = 0; // the latest open(): an older one's list arrives too late to show

    function item(role, text, act) {
      const node = el("button", "keel-item", text);
      node.type = "button";
      node.tabIndex = -1;
      node.setAttribute("role", role);
      node.onclick = () => {
        close();
        act();
      };
      return menu.appendChild(node);
    }

    function close() {
      opening += 1;
      menu.hidden = true;
      button.setAttribute("aria-expanded", "false");
    }

    async function open() {
      const mine = ++opening;
      let untitled = false;
      menu.replaceChildren();
      item("menuitem", "New conversation", () => fresh(untitled));
      menu.appendChild(el("hr")); // (a separator)
      const note = menu.appendChild(el("div", "keel-menu-note", "loading…"));
      menu.style.top = head.offsetHeight + 4 + "px";
      menu.hidden = false;
      menu.setAttribute("aria-busy", "true");
      button.setAttribute("aria-expanded", "true");
      menu.firstChild.focus();
      let listed;
      try {
        listed = await source.list();
      } catch (err) {
        if (mine === opening) note.textContent = "could not load the conversations";
        return;
      } finally {
        if (mine === opening) menu.removeAttribute("aria-busy");
      }
      if (mine !== opening) return;
      note.remove();
      for (const c of listed) {
        const current = c.session_id === showing();
        if (current && !c.title) untitled = true;
        const node = item("menuitemradio", c.title || "Untitled conversation", () => choose(c.session_id));
        node.setAttribute("aria-checked", String(current));
      }
    }

    button.onclick = () => (menu.hidden ? open() : close());
    menu.addEventListener("keydown", (e) => {
      const items = [...menu.querySelectorAll(".keel-item")];
      const at = items.indexOf(document.activeElement);
      const to = { ArrowDown: at + 1, ArrowUp: at - 1, Home: 0, End: items.length - 1 }[e.key];
      if (to !== undefined) {
        e.preventDefault();
        items[(to + items.length) % items.length].focus();
      } else if (e.key === "Escape") {
        e.preventDefault();
        close();
        button.focus();
      } else if (e.key === "Tab") {
        close();
      }
    });
    menu.addEventListener("focusout", (e) => {
      if (!menu.contains(e.relatedTarget) && e.relatedTarget !== button) close();
    });
    return button;
  }

  function mount(root, options) {
    const opts = Object.assign(
      {
        url: location.origin,
        title: "Assistant",
        context: null,
        question: null,
        onEvent: null,
        conversations: false,
        onSwitch: null,
      },
      options,
    );
    if (!opts.session) throw new Error("Keel.mount needs options.session");
    if (!document.getElementById("keel-style")) {
      const style = el("style");
      style.id = "keel-style";
      style.textContent = STYLE;
      document.head.appendChild(style);
    }
    const panel = el("div", "keel-panel");
    const head = el("div", "keel-head");
    const status = el("span", "keel-status", "connecting");
    head.append(el("span", "keel-title", opts.title), status);
    const log = el("div", "keel-log");
    const form = el("form", "keel-form");
    const input = el("input", "keel-input");
    input.placeholder = "Ask something";
    input.setAttribute("aria-label", "message");
    const send = el("button", "keel-send", "Send");
    send.type = "submit";
    form.append(input, send);
    panel.append(head, log, form);
    root.replaceChildren(panel);

    // what is shown is of one session; switching to another starts these afresh
    let session = null;
    const seen = new Set(); // event ids shown
    const nodes = new Map(); // item/call/request id -> element
    const completed = new Set(); // items whose message.completed came (their deltas are late)
    const partial = new Set(); // items shown from deltas only: gone if their turn ends without them
    const unsent = new Map(); // session -> its unacked, kept while another session is shown
    let unacked = null; // message_id -> frame, until its message.received arrives
    let lastId = null;
    let socket = null;
    let retry = 500;
    let again = null; // the reconnect timer
    let closed = false;
    let watchdog = null;
    let thinking = null;

    function show(sid) {
      clearTimeout(again);
      clearTimeout(watchdog);
      const old = socket;
      socket = null; // (its close is no reason to reconnect)
      if (old) old.close(1000);
      if (unacked && !unacked.size) unsent.delete(session);
      session = sid;
      if (!unsent.has(sid)) unsent.set(sid, new Map());
      unacked = unsent.get(sid);
      seen.clear();
      nodes.clear();
      completed.clear();
      partial.clear();
      lastId = null;
      retry = 500;
      thinking = null;
      log.replaceChildren();
      connect();
    }

    function switchTo(sid) {
      show(sid);
      input.focus();
      if (!opts.onSwitch) return;
      try {
        opts.onSwitch(sid);
      } catch (err) {
        console.error("Keel.mount onSwitch:", err);
      }
    }

    if (opts.conversations) {
      const source = opts.conversations === true ? keelConversations(opts.url) : opts.conversations;
      const fresh = async (untitled) => {
        if (untitled) return input.focus(); // nothing was said here: this is a new conversation
        try {
          switchTo(await source.create());
        } catch (err) {
          console.warn("Keel.mount conversations.create:", err);
          add(el("div", "keel-error", "could not start a new conversation"));
        }
      };
      const choose = (sid) => (sid === session ? input.focus() : switchTo(sid));
      head.prepend(conversationsMenu(panel, head, source, () => session, choose, fresh));
    }

    function add(node, eventId) {
      if (eventId) node.dataset.eventId = eventId;
      log.appendChild(node);
      log.scrollTop = log.scrollHeight;
      return node;
    }

    function setStatus(text) {
      status.textContent = text;
      root.dataset.keelStatus = text;
    }

    function transmit(frame) {
      if (socket && socket.readyState === WebSocket.OPEN) socket.send(JSON.stringify(frame));
    }

    async function token(sid) {
      if (typeof opts.token === "function") return await opts.token(sid);
      return opts.token || null;
    }

    async function connect() {
      if (closed) return;
      const sid = session;
      setStatus("connecting");
      let url = opts.url.replace(/^http/, "ws").replace(/\/$/, "") + "/v1/sessions/" + sid + "/ws";
      const params = new URLSearchParams();
      if (lastId) params.set("after", lastId);
      try {
        const t = await token(sid);
        if (t) params.set("token", t);
      } catch (err) {
        if (sid === session) later("could not get a token");
        return;
      }
      if (closed || sid !== session) return; // another session is shown now
      if ([...params].length) url += "?" + params;
      const ws = new WebSocket(url);
      socket = ws;
      ws.onopen = () => {
        if (ws !== socket) return;
        retry = 500;
        setStatus("connected");
        for (const frame of unacked.values()) transmit(frame); // same message_id: one message
        pet();
      };
      ws.onmessage = (msg) => {
        if (ws !== socket) return; // a frame of the session shown before
        pet();
        let frame;
        try {
          frame = JSON.parse(msg.data);
        } catch (err) {
          return;
        }
        if (frame.id) {
          if (seen.has(frame.id)) return; // never twice
          seen.add(frame.id);
          lastId = frame.id;
          render(frame);
          tell(frame);
        } else if (frame.type === EV.MessageDelta) {
          render(frame); // transient, no id: never counted as seen, never a resume point
        } else if (frame.type === "error") {
          add(el("div", "keel-error", frame.error.message));
        }
      };
      ws.onclose = (ev) => {
        if (ws !== socket) return;
        clearTimeout(watchdog);
        if (closed) return;
        if (ev.code === 4404) return setStatus("session not found");
        if (ev.code === 4403) return setStatus("origin not allowed");
        if (ev.code === 4401 && typeof opts.token !== "function") return setStatus("unauthorized");
        later("reconnecting");
      };
    }

    function tell(frame) {
      if (!opts.onEvent) return;
      try {
        opts.onEvent(frame);
      } catch (err) {
        console.error("Keel.mount onEvent:", err); // the page's bug: the panel goes on
      }
    }

    function later(why) {
      setStatus(why);
      again = setTimeout(connect, retry);
      retry = Math.min(retry * 2, 8000);
    }

    function pet() {
      // the server sends a heartbeat frame when idle; silence this long means a dead socket
      clearTimeout(watchdog);
      watchdog = setTimeout(() => socket && socket.close(), (opts.heartbeat || 15) * 2500);
    }

    function think(on) {
      if (on && !thinking) thinking = add(el("div", "keel-thinking", "thinking…"));
      if (!on && thinking) {
        thinking.remove();
        thinking = null;
      }
    }

    function dropPartial() {
      for (const id of partial) {
        const node = nodes.get(id);
        if (node) node.remove();
        nodes.delete(id);
      }
      partial.clear();
    }

    function render(ev) {
      const d = ev.data || {};
      switch (ev.type) {
        case EV.MessageReceived:
          unacked.delete(d.message_id);
          add(el("div", "keel-msg keel-user", d.text), ev.id);
          break;
        case EV.TurnStarted:
          think(true);
          break;
        case EV.MessageDelta: {
          // transient: appended only where it continues the text (offset, in code points);
          // the committed message.completed replaces it, and later deltas of it are ignored
          if (completed.has(d.item_id)) break;
          think(false); // the text itself shows the agent at work now
          let node = nodes.get(d.item_id);
          if (!node) {
            node = add(el("div", "keel-msg keel-assistant", ""), null);
            node.keelLength = 0;
            nodes.set(d.item_id, node);
            partial.add(d.item_id);
          }
          if (d.offset === 0 && node.keelLength > 0) {
            node.textContent = ""; // a retried attempt streams the item again from the start
            node.keelLength = 0;
          }
          if (d.offset === node.keelLength) {
            node.textContent += d.delta;
            node.keelLength += [...d.delta].length;
          }
          break;
        }
        case EV.MessageCompleted: {
          think(false);
          completed.add(d.item_id);
          partial.delete(d.item_id);
          const node = nodes.get(d.item_id);
          if (node) {
            node.textContent = d.text;
            node.dataset.eventId = ev.id;
          }
          else nodes.set(d.item_id, add(el("div", "keel-msg keel-assistant", d.text), ev.id));
          break;
        }
        case EV.ToolStarted: {
          think(false);
          const args = Object.entries(d.arguments || {}).map(([k, v]) => k + "=" + JSON.stringify(v));
          const node = add(el("div", "keel-tool", "⚙ " + d.tool + "(" + args.join(", ") + ") …"), ev.id);
          nodes.set(d.call_id, node);
          break;
        }
        case EV.ToolCompleted: {
          const text = "⚙ " + d.tool + " → " + d.result;
          const node = nodes.get(d.call_id);
          if (node) node.textContent = text;
          else add(el("div", "keel-tool", text), ev.id);
          break;
        }
        case EV.InputRequested:
          think(false);
          for (const r of d.requests || []) approval(r, ev.id);
          break;
        case EV.InputResolved: {
          const card = nodes.get(d.request_id);
          if (card) {
            const actions = card.querySelector(".keel-actions");
            if (actions) actions.remove();
            const said = { approve: "approved", deny: "denied", withdrawn: "withdrawn" }[d.decision];
            card.appendChild(el("div", "keel-note", said || d.decision));
            card.dataset.decision = d.decision;
          }
          break;
        }
        case EV.TurnCompleted:
        case EV.TurnCancelled:
          think(false);
          dropPartial();
          break;
        case EV.TurnFailed:
          think(false);
          dropPartial();
          add(el("div", "keel-error", (d.error && d.error.message) || "the turn failed"), ev.id);
          break;
        case EV.CompactionCompleted:
          add(el("div", "keel-note", "earlier conversation summarized"), ev.id);
          break;
        case EV.ContextCleared:
          add(el("div", "keel-note", "conversation cleared"), ev.id);
          break;
      }
    }

    function asked(r) {
      let said = null;
      try {
        said = opts.question ? opts.question(r) : null;
      } catch (err) {
        console.error("Keel.mount question:", err);
      }
      return typeof said === "string" && said.trim() ? said : question(r);
    }

    function approval(r, eventId) {
      // what will happen, in words; then the call itself: the tool and each argument
      const card = el("div", "keel-approval");
      card.dataset.requestId = r.request_id;
      card.appendChild(el("div", "keel-question", asked(r)));
      card.appendChild(el("div", "keel-call", "⚙ " + r.tool));
      const args = el("dl", "keel-args");
      for (const [name, value] of Object.entries(r.arguments || {})) {
        args.append(el("dt", "", name), el("dd", "", shown(value)));
      }
      if (args.childElementCount) card.appendChild(args);
      const actions = el("div", "keel-actions");
      for (const [label, decision] of [["Approve", "approve"], ["Deny", "deny"]]) {
        const button = el("button", "", label);
        button.type = "button";
        button.onclick = () => {
          card.querySelectorAll("button").forEach((b) => (b.disabled = true));
          transmit({ type: "respond", request_id: r.request_id, decision: decision });
        };
        actions.appendChild(button);
      }
      card.appendChild(actions);
      nodes.set(r.request_id, add(card, eventId));
    }

    form.addEventListener("submit", (e) => {
      e.preventDefault();
      const text = input.value.trim();
      if (!text) return;
      input.value = "";
      let context = null;
      try {
        context = opts.context ? opts.context() : null;
      } catch (err) {
        context = null;
      }
      const frame = { type: "message", text: text, message_id: newId() };
      if (context !== null && context !== undefined) frame.context = context;
      unacked.set(frame.message_id, frame);
      transmit(frame);
    });

    show(opts.session);
    return {
      close() {
        closed = true;
        clearTimeout(again);
        clearTimeout(watchdog);
        if (socket) socket.close(1000);
      },
    };
  }

  window.Keel = { mount: mount };
})();
