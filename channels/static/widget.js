/* keel's embeddable assistant panel. No build step, no framework.

   <script src="https://your-keel/widget.js"></script>
   <script>
     Keel.mount(document.getElementById("assistant"), {
       url: "https://your-keel",          // keel's base URL (default: this page's origin)
       session: "ses_...",                 // the session to show
       token: async () => fetchTokenFromYourBackend(),  // or a string; re-asked on reconnect
       context: () => ({ route: location.pathname, selection: currentSelection() }),
       question: (request) => null,        // optional: an approval's question in your words
       onEvent: (event) => {},             // optional: each committed event, once (see below)
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
   agent did, e.g. `tool.completed`. */
(function () {
  "use strict";

  // keel's event types by name, from its catalogue (harness/events.py): filled in when served
  const EV = /* keel: events */ {};

  const STYLE = `
.keel-panel{font:14px/1.4 system-ui,sans-serif;display:flex;flex-direction:column;height:100%;
  border:1px solid #d0d4da;border-radius:8px;background:#fff;color:#1d232b;overflow:hidden}
.keel-panel *,.keel-panel *::before,.keel-panel *::after{box-sizing:border-box}
.keel-head{padding:8px 12px;background:#1d232b;color:#fff;font-weight:600;display:flex;gap:8px}
.keel-status{margin-left:auto;font-weight:400;opacity:.8}
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

  function mount(root, options) {
    const opts = Object.assign(
      { url: location.origin, title: "Assistant", context: null, question: null, onEvent: null },
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
    const head = el("div", "keel-head", opts.title);
    const status = el("span", "keel-status", "connecting");
    head.appendChild(status);
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

    const seen = new Set(); // event ids shown
    const unacked = new Map(); // message_id -> frame, until its message.received arrives
    const nodes = new Map(); // item/call/request id -> element
    const completed = new Set(); // items whose message.completed came (their deltas are late)
    const partial = new Set(); // items shown from deltas only: gone if their turn ends without them
    let lastId = null;
    let socket = null;
    let retry = 500;
    let closed = false;
    let watchdog = null;
    let thinking = null;

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

    async function token() {
      if (typeof opts.token === "function") return await opts.token();
      return opts.token || null;
    }

    async function connect() {
      if (closed) return;
      setStatus("connecting");
      let url = opts.url.replace(/^http/, "ws").replace(/\/$/, "") + "/v1/sessions/" + opts.session + "/ws";
      const params = new URLSearchParams();
      if (lastId) params.set("after", lastId);
      try {
        const t = await token();
        if (t) params.set("token", t);
      } catch (err) {
        return later("could not get a token");
      }
      if ([...params].length) url += "?" + params;
      socket = new WebSocket(url);
      socket.onopen = () => {
        retry = 500;
        setStatus("connected");
        for (const frame of unacked.values()) transmit(frame); // same message_id: one message
        pet();
      };
      socket.onmessage = (msg) => {
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
      socket.onclose = (ev) => {
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
      setTimeout(connect, retry);
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

    connect();
    return {
      close() {
        closed = true;
        clearTimeout(watchdog);
        if (socket) socket.close(1000);
      },
    };
  }

  window.Keel = { mount: mount };
})();
