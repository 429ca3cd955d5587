// The AI SDK's own client code against keel's /v1/chat: a headless chat built on `ai`'s
// AbstractChat with DefaultChatTransport (whose stream parser checks every chunk against the
// package's uiMessageChunkSchema, and throws on one that fails), and readUIMessageStream.
//
//   node chat.mjs <scenario> <base url> <session id> [api key]
//
// Prints one JSON line per step to stdout ({"event": ...}); the last is {"event": "done", ...}
// with what the chat holds. Reads lines on stdin when a scenario waits for the test (resume).
import readline from "node:readline";
import {
  AbstractChat,
  DefaultChatTransport,
  lastAssistantMessageIsCompleteWithApprovalResponses,
  readUIMessageStream,
} from "ai";

const [scenario, base, sessionId, apiKey] = process.argv.slice(2);
const headers = apiKey ? { Authorization: `Bearer ${apiKey}` } : {};
const seen = []; // every chunk any stream of this run carried, after the transport's schema check
const warnings = [];
const log = (event, extra = {}) => process.stdout.write(JSON.stringify({ event, ...extra }) + "\n");
console.warn = (...args) => warnings.push(args.map(String).join(" "));

const input = readline.createInterface({ input: process.stdin });
const lines = input[Symbol.asyncIterator]();
const nextLine = async () => (await lines.next()).value;

class RecordingTransport extends DefaultChatTransport {
  processResponseStream(stream) {
    return super.processResponseStream(stream).pipeThrough(
      new TransformStream({
        transform(chunk, controller) {
          seen.push(chunk);
          controller.enqueue(chunk);
        },
      }),
    );
  }
}

class State {
  constructor(messages = []) {
    this.watchers = new Set();
    this.messages = messages;
    this._status = "ready";
    this.error = undefined;
  }
  get status() {
    return this._status;
  }
  set status(s) {
    this._status = s;
    this.changed();
  }
  pushMessage = (m) => {
    this.messages = this.messages.concat(m);
    this.changed();
  };
  popMessage = () => {
    this.messages = this.messages.slice(0, -1);
    this.changed();
  };
  replaceMessage = (i, m) => {
    this.messages = [...this.messages.slice(0, i), this.snapshot(m), ...this.messages.slice(i + 1)];
    this.changed();
  };
  snapshot = (v) => structuredClone(v);
  changed() {
    for (const w of this.watchers) w();
  }
}

class HeadlessChat extends AbstractChat {
  constructor(init) {
    const state = new State(init.messages ?? []);
    super({ ...init, state });
    this.chatState = state;
  }
  // resolves when `test(this)` holds, checked on every change of messages or status
  until(test, what, ms = 10000) {
    return new Promise((resolve, reject) => {
      const timer = setTimeout(() => {
        this.chatState.watchers.delete(check);
        reject(new Error(`timed out waiting for ${what}; status ${this.status}; ${JSON.stringify(this.messages)}`));
      }, ms);
      const check = () => {
        if (test(this)) {
          clearTimeout(timer);
          this.chatState.watchers.delete(check);
          resolve();
        }
      };
      this.chatState.watchers.add(check);
      check();
    });
  }
}

function newChat(extra = {}) {
  const transport = new RecordingTransport({ api: `${base}/v1/chat`, headers, body: { context: { page: "/checkout" } } });
  return new HeadlessChat({
    id: sessionId,
    transport,
    sendAutomaticallyWhen: lastAssistantMessageIsCompleteWithApprovalResponses,
    onError: (e) => log("error", { message: String(e?.message ?? e) }),
    ...extra,
  });
}

const settled = (c) => c.status === "ready" || c.status === "error";
const textOf = (m) => m.parts.filter((p) => p.type === "text").map((p) => p.text).join("");
const toolParts = (m) => m.parts.filter((p) => p.type.startsWith("tool-") || p.type === "dynamic-tool");

function finish(chat) {
  log("done", {
    status: chat.status,
    error: chat.error ? String(chat.error.message ?? chat.error) : null,
    messages: chat.messages.map((m) => ({
      id: m.id,
      role: m.role,
      text: textOf(m),
      tools: toolParts(m),
      metadata: m.metadata ?? null,
    })),
    chunks: seen,
    warnings,
  });
}

async function main() {
  const chat = newChat();
  if (scenario === "text" || scenario === "tools") {
    await chat.sendMessage({ text: scenario === "text" ? "hello from useChat" : "weather Lisbon" });
    await chat.until(settled, "the reply");
    finish(chat);
  } else if (scenario === "regenerate") {
    // two turns, then the last reply made again (keel forks the session before its message)
    await chat.sendMessage({ text: "hello one" });
    await chat.until(settled, "the first reply");
    await chat.sendMessage({ text: "hello two" });
    await chat.until(settled, "the second reply");
    log("sent", { replied: chat.messages.at(-1).id });
    await chat.regenerate();
    await chat.until(settled, "the reply made again");
    finish(chat);
  } else if (scenario === "approve" || scenario === "deny") {
    await chat.sendMessage({ text: "pay 42" });
    const asked = (c) => c.messages.at(-1)?.parts.some((p) => p.state === "approval-requested");
    await chat.until((c) => settled(c) && asked(c), "the approval request");
    const part = chat.messages.at(-1).parts.find((p) => p.state === "approval-requested");
    log("asked", { approval: part.approval, toolCallId: part.toolCallId });
    const approved = scenario === "approve";
    await chat.addToolApprovalResponse({ id: part.approval.id, approved, reason: approved ? undefined : "not today" });
    const done = (c) => toolParts(c.messages.at(-1)).every((p) => p.state.startsWith("output-"));
    await chat.until((c) => settled(c) && done(c), "the rest of the turn");
    finish(chat);
  } else if (scenario === "drop-and-resume") {
    // the page sends, then goes away mid-turn (its fetch aborted); a new page resumes
    const sending = chat.sendMessage({ text: "slow" });
    const begun = (c) => c.messages.at(-1)?.role === "assistant"; // (its start chunk came)
    await chat.until(begun, "the stream to begin");
    log("streaming");
    await chat.stop(); // (the client stops reading: keel's turn goes on)
    await sending.catch(() => {});
    const reloaded = newChat();
    const resuming = reloaded.resumeStream();
    await reloaded.until(begun, "the resumed stream");
    log("resumed");
    await nextLine(); // the test lets the turn go on now
    await resuming;
    await reloaded.until(settled, "the resumed reply");
    finish(reloaded);
  } else if (scenario === "crash-resume") {
    // keel dies mid-reply (the test kills it): the stream breaks; the page reloads and resumes
    // once the test has keel back; the test lets the re-run reply go on after the resume began
    const sending = chat.sendMessage({ text: "hello" });
    const partial = (c) => textOf(c.messages.at(-1) ?? { parts: [] }).length > 0 && c.messages.at(-1).role === "assistant";
    await chat.until(partial, "some of the reply", 20000);
    log("partial", { text: textOf(chat.messages.at(-1)) });
    await sending.catch(() => {});
    await chat.until(settled, "the stream to break", 20000);
    log("dropped", { status: chat.status, text: textOf(chat.messages.at(-1)) });
    await nextLine(); // keel is back
    const reloaded = newChat();
    const resuming = reloaded.resumeStream();
    await reloaded.until((c) => c.messages.at(-1)?.role === "assistant", "the resumed stream", 20000);
    log("resumed");
    await nextLine(); // the re-run reply may go on
    await resuming;
    await reloaded.until(settled, "the resumed reply", 20000);
    finish(reloaded);
  } else if (scenario === "resume") {
    // a page (re)loaded while a turn runs, or runs no more (204: nothing to resume)
    const resuming = chat.resumeStream();
    log("resuming");
    await resuming;
    await chat.until(settled, "the resumed reply");
    finish(chat);
  } else if (scenario === "replay") {
    // a UI message stream given on stdin (SSE bytes, as keel sent them), through the
    // transport's own parser and schema check and readUIMessageStream: the message it makes
    const body = JSON.parse(await nextLine());
    const bytes = new ReadableStream({
      start(c) {
        c.enqueue(new TextEncoder().encode(body));
        c.close();
      },
    });
    const stream = new RecordingTransport({ api: "unused" }).processResponseStream(bytes);
    let last;
    for await (const m of readUIMessageStream({ stream, terminateOnError: true })) last = m;
    log("done", { messages: [{ id: last.id, role: last.role, text: textOf(last), parts: last.parts }], chunks: seen, warnings });
  } else if (scenario === "read") {
    // the transport's stream read into UI messages by readUIMessageStream
    const transport = new RecordingTransport({ api: `${base}/v1/chat`, headers });
    const message = { id: "read-1", role: "user", parts: [{ type: "text", text: "weather Porto" }] };
    const stream = await transport.sendMessages({ chatId: sessionId, messages: [message], trigger: "submit-message" });
    let last;
    for await (const m of readUIMessageStream({ stream, terminateOnError: true })) last = m;
    log("done", {
      messages: [{ id: last.id, role: last.role, text: textOf(last), tools: toolParts(last) }],
      chunks: seen,
      warnings,
    });
  } else {
    throw new Error(`no scenario ${scenario}`);
  }
}

main()
  .then(() => process.exit(0))
  .catch((e) => {
    log("failed", { message: String(e?.stack ?? e), chunks: seen });
    process.exit(1);
  });
