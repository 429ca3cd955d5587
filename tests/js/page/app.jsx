// A small page on the AI SDK's useChat against keel's /v1/chat (tests/browser/test_usechat.py
// bundles it with esbuild and serves it beside keel, same origin, or from an origin of its own).
//   index.html?session=<keel session id>&api=<keel base url>&key=<api key, optional>
//   index.html?session=<keel session id>&api=<keel base url>&token=<the session's token>
// (a key or a session token from POST /v1/sessions/{id}/tokens: either goes as `Bearer`)
import { useChat } from "@ai-sdk/react";
import { DefaultChatTransport, lastAssistantMessageIsCompleteWithApprovalResponses } from "ai";
import { useState } from "react";
import { createRoot } from "react-dom/client";

const params = new URLSearchParams(location.search);
const session = params.get("session");
const api = params.get("api") || location.origin;
const credential = params.get("token") || params.get("key");

const transport = new DefaultChatTransport({
  api: `${api}/v1/chat`,
  headers: credential ? { Authorization: `Bearer ${credential}` } : {},
  body: { context: { page: "/usechat" } },
});

const isTool = (part) => part.type.startsWith("tool-") || part.type === "dynamic-tool";
const toolName = (part) => (part.type === "dynamic-tool" ? part.toolName : part.type.slice(5));

function ToolPart({ part, approve }) {
  return (
    <div className="tool" data-tool={toolName(part)} data-state={part.state} data-call={part.toolCallId}>
      <span className="tool-name">{toolName(part)}</span> <span className="tool-input">{JSON.stringify(part.input)}</span>{" "}
      <span className="tool-state">{part.state}</span>
      {part.state === "output-available" && <span className="tool-output"> → {JSON.stringify(part.output)}</span>}
      {part.state === "output-error" && <span className="tool-output"> ✗ {part.errorText}</span>}
      {part.state === "approval-requested" && (
        <button type="button" onClick={() => approve({ id: part.approval.id, approved: true })}>
          Approve
        </button>
      )}
    </div>
  );
}

function Message({ message, approve }) {
  return (
    <li className={`message ${message.role}`} data-id={message.id}>
      <div className="role">{message.role}</div>
      {message.parts.map((part, i) => {
        if (part.type === "text") return <p key={i} className="text">{part.text}</p>;
        if (isTool(part)) return <ToolPart key={part.toolCallId} part={part} approve={approve} />;
        return null; // (step-start and the like)
      })}
    </li>
  );
}

function App() {
  const [input, setInput] = useState("");
  const { messages, status, error, sendMessage, addToolApprovalResponse } = useChat({
    id: session,
    transport,
    sendAutomaticallyWhen: lastAssistantMessageIsCompleteWithApprovalResponses,
    resume: true,
  });
  const submit = (e) => {
    e.preventDefault();
    if (!input.trim()) return;
    sendMessage({ text: input });
    setInput("");
  };
  return (
    <main id="chat" data-status={status}>
      <h1>useChat on keel</h1>
      <ol id="messages">
        {messages.map((m) => (
          <Message key={m.id} message={m} approve={addToolApprovalResponse} />
        ))}
      </ol>
      {error && <p id="error">{String(error.message || error)}</p>}
      <form onSubmit={submit}>
        <input id="prompt" aria-label="Message" value={input} onChange={(e) => setInput(e.target.value)} />
        <button type="submit">Send</button>
      </form>
    </main>
  );
}

if (!session) throw new Error("the page needs ?session=<keel session id>");
createRoot(document.getElementById("root")).render(<App />);
