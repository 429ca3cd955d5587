// The AG-UI client's own code against keel's /v1/agui: @ag-ui/client's HttpAgent, whose
// pipeline checks every event against @ag-ui/core's schemas (enforceEvents) and the protocol's
// ordering rules (verifyEvents) before it applies it to the agent's messages; a check that
// fails rejects runAgent (and prints "Agent execution failed" on console.error).
//
//   node agui.mjs <scenario> <base url> <session id> [api key]
//
// Prints one JSON line per step to stdout ({"event": ...}); the last is {"event": "done", ...}
// with every run's events (as the subscriber got them), the agent's messages, the warnings and
// errors the client printed, and its pending interrupts. Reads lines on stdin when a scenario
// waits for the test (drop-and-resume).
import readline from "node:readline";
import { HttpAgent } from "@ag-ui/client";

const [scenario, base, sessionId, apiKey] = process.argv.slice(2);
const headers = apiKey ? { Authorization: `Bearer ${apiKey}` } : {};
const warnings = []; // every console.warn / console.error of the client
const runs = []; // one entry per runAgent: its events and outcome
const log = (event, extra = {}) => process.stdout.write(JSON.stringify({ event, ...extra }) + "\n");
const said = (args) => args.map((a) => (a instanceof Error ? a.message : String(a))).join(" ");
console.warn = (...args) => warnings.push(said(args));
console.error = (...args) => warnings.push(`error: ${said(args)}`);

const input = readline.createInterface({ input: process.stdin });
const lines = input[Symbol.asyncIterator]();
const nextLine = async () => (await lines.next()).value;

let keptAlive = () => {}; // called on each keep-alive comment a response carried

// fetch as HttpAgent's default does, its response body read through unchanged: SSE comments
// (keel's keep-alives) never reach a subscriber, so they are counted on the way
async function fetchCounting(url, init) {
  const response = await fetch(url, init);
  if (!response.body) return response;
  const decoder = new TextDecoder();
  const body = response.body.pipeThrough(
    new TransformStream({
      transform(chunk, controller) {
        const text = decoder.decode(chunk, { stream: true });
        for (let i = text.indexOf(": keep-alive"); i !== -1; i = text.indexOf(": keep-alive", i + 1)) keptAlive();
        controller.enqueue(chunk);
      },
    }),
  );
  return new Response(body, { status: response.status, statusText: response.statusText, headers: response.headers });
}

const newAgent = (initialMessages) =>
  new HttpAgent({ url: `${base}/v1/agui`, headers, threadId: sessionId, initialMessages, fetch: fetchCounting });
const agent = newAgent();

function say(id, text) {
  agent.addMessage({ id, role: "user", content: text });
}

// one runAgent of `by` with a subscriber recording what the client delivered; `on` adds callbacks
async function run(params = {}, on = {}, by = agent) {
  const record = {
    runId: params.runId,
    events: [],
    outcome: null,
    interrupts: null,
    error: null,
    failed: null,
    keepAlives: 0,
  };
  runs.push(record);
  keptAlive = () => {
    record.keepAlives += 1;
    on.keptAlive?.(record.keepAlives);
  };
  const subscriber = {
    onEvent: ({ event }) => {
      record.events.push(event);
    },
    onRunStartedEvent: (p) => {
      record.runId = p.event.runId;
      return on.started?.(p);
    },
    onRunFinishedEvent: (p) => {
      record.outcome = p.outcome;
      record.interrupts = p.interrupts ?? null;
      record.pending = p.pendingToolCallIds ?? null;
    },
    onRunErrorEvent: ({ event }) => {
      record.error = { message: event.message, code: event.code ?? null };
    },
    onRunFailed: ({ error }) => {
      record.failed = String(error?.message ?? error);
    },
  };
  const result = await by.runAgent(params, subscriber); // (a verifier error rejects this)
  const last = record.events.at(-1)?.type;
  if (last !== "RUN_FINISHED" && last !== "RUN_ERROR") {
    throw new Error(`run ${runs.length} ended without RUN_FINISHED or RUN_ERROR (last: ${last})`);
  }
  record.newMessages = result.newMessages;
  return record;
}

// the events without the noise of timestamps (and rawEvent: an abort's is an Error)
const plain = (e) => {
  const { timestamp, rawEvent, ...rest } = e;
  return rest;
};

function finish(extra = {}) {
  log("done", {
    runs: runs.map((r) => ({ ...r, events: r.events.map(plain), newMessages: r.newMessages ?? null })),
    messages: agent.messages,
    ...extra,
    pendingInterrupts: agent.pendingInterrupts,
    warnings,
  });
}

async function main() {
  if (scenario === "text" || scenario === "tools") {
    say("u-1", scenario === "text" ? "hello" : "weather Rome");
    await run({ runId: "run-1" });
    finish();
  } else if (scenario === "approve" || scenario === "deny" || scenario === "cancel") {
    say("u-1", "pay 7");
    const asked = await run({ runId: "run-1" });
    if (asked.outcome !== "interrupt") throw new Error(`the run ended ${asked.outcome}, not interrupt`);
    const interrupt = agent.pendingInterrupts[0];
    log("asked", { interrupts: agent.pendingInterrupts });
    const entry =
      scenario === "approve"
        ? { interruptId: interrupt.id, status: "resolved", payload: { approved: true } }
        : scenario === "deny"
          ? { interruptId: interrupt.id, status: "resolved", payload: { approved: false, reason: "not today" } }
          : { interruptId: interrupt.id, status: "cancelled" };
    await run({ runId: "run-2", resume: [entry] });
    finish();
  } else if (scenario === "drop-and-resume") {
    // the page sends, then goes away once its run began (its fetch aborted): keel's turn goes on
    say("u-1", "slow");
    await run({ runId: "run-1" }, { started: () => agent.abortRun() });
    log("dropped");
    // the page runs the thread again, the same user message last: the same turn, followed
    let began;
    const started = new Promise((resolve) => (began = resolve));
    const again = run(
      { runId: "run-2" },
      { started: () => began(), keptAlive: (n) => n === 1 && log("kept-alive") },
    );
    await Promise.race([started, again]);
    log("resumed");
    await nextLine(); // the test lets the turn go on now
    await again;
    // a page reloaded with only what its user typed runs the thread once more: the turn, replayed
    const reloaded = newAgent([structuredClone(agent.messages[0])]);
    await run({ runId: "run-3" }, {}, reloaded);
    finish({ reloaded: reloaded.messages });
  } else {
    throw new Error(`no scenario ${scenario}`);
  }
}

main()
  .then(() => process.exit(0))
  .catch((e) => {
    log("failed", {
      message: String(e?.stack ?? e),
      runs: runs.map((r) => ({ ...r, events: r.events.map(plain) })),
      warnings,
    });
    process.exit(1);
  });
