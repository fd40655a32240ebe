// Compiled by `tsc` in the tests (never shipped): the README's examples, typed.
import WsinferClientDefault, {
  WsinferClient,
  WsinferError,
  type DoneDetail,
  type WsinferTurn,
} from "wsinfer-client";

const client: WsinferClient = new WsinferClientDefault({
  url: "ws://127.0.0.1:8000/v1/ws",
  storage: localStorage,
  storageKey: "my-chat",
});

// Stream an answer.
async function ask(question: string): Promise<string> {
  const turn = client.generate({
    messages: [{ role: "user", content: question }],
    params: { max_new_tokens: 128, temperature: 0 },
  });
  let text = "";
  for await (const piece of turn) text += piece;
  turn.control("pause"); // any control of a turn by its declared type
  const done: DoneDetail = await turn.finished;
  return done.finishReason === "length" ? text + "…" : text;
}

// An answer cut by max_new_tokens goes on: the same turn, its text longer
// (a refusal, e.g. from an older server, leaves it as it was).
function more(turn: WsinferTurn): Promise<string> {
  return new Promise((resolve) => {
    if (turn.finishReason !== "length") return resolve(turn.text);
    turn.addEventListener("done", (e) => resolve(e.detail.text), { once: true });
    turn.addEventListener("error", () => resolve(turn.text), { once: true });
    turn.continue();
  });
}

// How sure the model was of each token of an answer.
async function confidence(question: string): Promise<number[]> {
  const turn = client.generate({
    messages: [{ role: "user", content: question }],
    params: { temperature: 0, logprobs: true, top_logprobs: 3 },
  });
  turn.addEventListener("delta", (e) => console.log(e.detail.logprobs?.[0]?.top_logprobs?.[0]?.token));
  await turn.finished;
  return turn.logprobs.map((entry) => Math.exp(entry.logprob));
}

// A required tool call, and its result sent back as the next turn's message.
async function weather(city: string): Promise<string> {
  const tools = [{ type: "function" as const, function: { name: "get_weather", parameters: { type: "object" } } }];
  const turn = client.generate({
    messages: [{ role: "user", content: `Weather in ${city}?` }],
    params: { tools, tool_choice: "required", parallel_tool_calls: false },
  });
  turn.addEventListener("delta", (e) => console.log(e.detail.toolCalls?.[0]?.function.name));
  turn.addEventListener("delta", (e) => {
    for (const part of e.detail.toolCallParts ?? []) console.log(part.index, part.function.arguments);
  });
  const done: DoneDetail = await turn.finished;
  const call = turn.toolCalls[0];
  if (done.finishReason !== "tool_calls" || !call) return turn.text;
  const next = client.generate({
    messages: [{ role: "tool", content: "sunny", tool_call_id: call.id }],
    params: { tools },
  });
  return (await next.finished).text;
}

// Resume after a reload: the answer continues from the last seq, no gap, no repeat.
const restored: WsinferTurn | null = client.restoreTurn();
if (restored) {
  restored.addEventListener("delta", (e) => console.log(e.detail.seq, e.detail.text.length));
  restored.addEventListener("done", (e) => console.log(e.detail.finishReason, e.detail.usage?.cached_tokens));
}

client.addEventListener("reconnecting", (e) => console.log(e.detail.attempt, e.detail.delay));
client.addEventListener("resumed", (e) => console.log(e.detail.after, e.detail.restored === true));
client.addEventListener("error", (e) => {
  const err: WsinferError = e.error;
  if (err.code === "overloaded") console.log(err.retryAfter ?? 0);
});

try {
  await ask("hi");
  if (client.currentTurn) await more(client.currentTurn);
  await weather("Paris");
} catch (err) {
  if (err instanceof WsinferError && err.code === "not_found") client.close();
}
const state: "idle" | "connecting" | "open" | "reconnecting" | "closed" = client.state;
client.disconnect();
export { state };
