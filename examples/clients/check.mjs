#!/usr/bin/env node
// check.mjs runs multi-turn conversations through a bidikv proxy with the
// official OpenAI and Anthropic SDKs, unmodified, the way agents use them:
// the whole history every turn with the assistant's output appended as it
// came back. It checks every turn (the SDK parses it, the text is non-empty,
// equals a single engine's answer when --reference is given and is the same
// on a second identical run, no kv_transfer_params byte reaches the client,
// X-Bidikv-Reuse shows hits, or local, where the proxy can reuse), checks that
// malformed requests raise the SDKs' own BadRequestError, prints a summary
// table and exits 1 on any failure.
//
//   node check.mjs <proxy-base-url> [--reference <engine-base-url>]
//                  [--model NAME] [--turns N] [--api-key KEY]
//                  [--second-key KEY] [--buffered] [--no-stream-handles]
//                  [--json]
//
// --api-key is a key the proxy accepts (its --api-key): both SDKs send it,
// and a wrong key must raise each SDK's AuthenticationError.
//
// --second-key is another key the proxy accepts, another tenant: on every
// API, tenant B resends tenant A's exact history through the SDKs, with the
// keys in either header (Authorization: Bearer, X-Api-Key); B must never
// reuse A's KV (X-Bidikv-Reuse: miss) and A's own next turn, by the other
// header, must hit.
//
// --no-stream-handles says the decode engines' chat and completions streams
// carry no handle (stock vLLM: PR #40186 is unmerged; the simulator without
// --stream-handles); Responses streams still do (response.completed, PR
// #37424): streamed chat and completions turns then miss, unless --buffered
// says the proxy runs with --decode-stream
// buffered, which writes chat, completions and Messages answers as the
// API's stream once complete (the SDKs' stream helpers must parse them
// unchanged) and makes their later turns hit. On such engines the proxy
// learns from the first chat and the first completions stream that the
// engine's streams carry no handle: that one turn is not retained, so on a
// proxy that has not seen such a stream yet the first streamed conversation
// of each of these APIs hits from turn 3 (its turn 2 may hit or miss).
// Messages streams (vLLM's never carry a handle) hit from turn 2 with
// --buffered whatever the engines.
//
// --reference is one engine serving the same model without disaggregation
// (a plain vllmsim, or one vLLM server with greedy sampling): every turn is
// sent to it too and the texts must be equal. Without it the suite runs
// twice and the texts of the two runs must be equal.
import OpenAI from 'openai';
import Anthropic from '@anthropic-ai/sdk';

const usage = 'usage: node check.mjs <proxy-base-url> [--reference URL] [--model NAME] [--turns N] [--api-key KEY] [--second-key KEY] [--buffered] [--no-stream-handles] [--json]';
const args = process.argv.slice(2);
const opt = { base: '', reference: '', model: 'sim-model', turns: 4, apiKey: '', secondKey: '', buffered: false, noStreamHandles: false, json: false };
for (let i = 0; i < args.length; i++) {
  const a = args[i];
  const val = () => {
    if (i + 1 >= args.length) fatal(`${a} needs a value\n${usage}`);
    return args[++i];
  };
  if (a === '--reference') opt.reference = val();
  else if (a === '--model') opt.model = val();
  else if (a === '--turns') opt.turns = Number(val());
  else if (a === '--api-key') opt.apiKey = val();
  else if (a === '--second-key') opt.secondKey = val();
  else if (a === '--json') opt.json = true;
  else if (a === '--buffered') opt.buffered = true;
  else if (a === '--no-stream-handles') opt.noStreamHandles = true;
  else if (a.startsWith('--')) fatal(`unknown flag ${a}\n${usage}`);
  else if (!opt.base) opt.base = a;
  else fatal(usage);
}
if (!opt.base || !(opt.turns >= 2) || (opt.secondKey && !opt.apiKey)) fatal(usage);
opt.base = opt.base.replace(/\/+$/, '');
opt.reference = opt.reference.replace(/\/+$/, '');

function fatal(msg) {
  console.error(msg);
  process.exit(2);
}

// Words the client must never see: a KV handle and its members.
const HANDLE_WORDS = ['kv_transfer_params', 'remote_block_ids', 'remote_engine_id'];

// A long shared system prompt: over the proxy's 64-token recompute
// threshold, so turn 1's KV is worth pulling on turn 2.
const SYSTEM = 'You are a coding agent working in a large Go repository. You can list files, read them, run the tests and edit code. ' +
  'Think about the failing tests before you change anything, keep changes small, explain each step in one sentence, ' +
  'and never invent file names: list the directory first. When the tests pass, summarise what you changed and why.';

// nonce makes this invocation's conversations new to a proxy that has seen
// an earlier one (turn 1 is then a miss); both runs of one invocation share it.
const nonce = Math.random().toString(16).slice(2, 10);
// askTag tells the tenant cases' conversations from the scenarios' own.
let askTag = '';
const ask = (conv, i) => `[${conv}${askTag} ${nonce}] Turn ${i + 1}: look at the tool output and continue the plan. ` +
  `The file has ${100 + 7 * i} lines and the suite reports ${i % 5} failures in module m${i}.`;

// recorder wraps fetch: it keeps every exchange's URL, request body,
// status, headers and raw response bytes (a clone, so the SDK reads the
// original untouched).
function recorder() {
  const log = [];
  const fetchFn = async (url, init) => {
    const res = await fetch(url, init);
    const ex = { url: String(url), method: init?.method ?? 'GET', init, body: typeof init?.body === 'string' ? init.body : '', status: res.status, headers: res.headers };
    ex.raw = res.clone().text();
    log.push(ex);
    return res;
  };
  return { log, fetchFn };
}

// clients are the two SDKs as users make them: both send their apiKey as
// Authorization: Bearer (Claude Code and older Anthropic SDKs send
// X-Api-Key: the 'anthropic X-Api-Key header' case and tenantCases).
function clients(base, rec, key = opt.apiKey || 'sk-no-key-needed') {
  return {
    openai: new OpenAI({ apiKey: key, baseURL: base + '/v1', maxRetries: 0, timeout: 60_000, fetch: rec.fetchFn }),
    anthropic: new Anthropic({ apiKey: key, baseURL: base, maxRetries: 0, timeout: 60_000, fetch: rec.fetchFn }),
  };
}

// --- scenarios -------------------------------------------------------------
// Each scenario is a conversation: start() makes the state, turn(sdk, state,
// i) sends turn i and returns { text, stream }, after appending what the
// agent appends to its history. stream says the conversation streams;
// expectReuse gives the X-Bidikv-Reuse expected on each turn.

// expectReuse is the X-Bidikv-Reuse ("hit" or "miss") of turn i of the
// scenario sc in run: turn 1 misses; a later one hits, unless it streams
// and the engines' streams of its API carry no handle without the proxy
// buffering them (see --buffered); '' (either) for the turn after the one
// stream that may have shown the proxy the engine's streams carry none.
function expectReuse(sc, i, run) {
  if (i === 0) return 'miss';
  if (!sc.stream) return 'hit';
  const buffered = opt.buffered && sc.api !== 'responses';
  // vLLM's Messages streams never carry a handle, its Responses streams
  // always do (response.completed), chat and completions ones with PR #40186.
  const handles = sc.api === 'responses' || (sc.api !== 'messages' && !opt.noStreamHandles);
  if (!buffered && !handles) return 'miss';
  if (buffered && !handles && sc.api !== 'messages' && run === 0 && i === 1 && firstStream(sc.api) === sc) return '';
  return 'hit';
}

// firstStream is the first streaming scenario of api, in the order run.
const firstStream = (api) => scenarios.find((s) => s.api === api && s.stream);

const shellTool = { type: 'function', function: { name: 'shell', description: 'Runs a shell command.', parameters: { type: 'object', properties: { command: { type: 'array', items: { type: 'string' } } }, required: ['command'] } } };

// A tool round as an agent records it after the model asked for a tool.
function chatToolRound(msgs, i) {
  const id = `call_${i}`;
  msgs.push({ role: 'assistant', content: null, tool_calls: [{ id, type: 'function', function: { name: 'shell', arguments: JSON.stringify({ command: ['go', 'test', `./m${i}/...`] }) } }] });
  msgs.push({ role: 'tool', tool_call_id: id, content: `ok  \tm${i}\t0.${i}12s\n--- FAIL: TestTurn${i} (0.00s)` });
}

function chatStream(conv, includeUsage) {
  return {
    name: conv, api: 'chat', stream: true,
    start: () => ({ msgs: [{ role: 'system', content: SYSTEM }] }),
    async turn(sdk, st, i) {
      st.msgs.push({ role: 'user', content: ask(conv, i) });
      const params = { model: opt.model, messages: st.msgs, max_tokens: 24, stream: true };
      if (includeUsage !== undefined) params.stream_options = { include_usage: includeUsage };
      const s = await sdk.openai.chat.completions.create(params);
      let text = '', reasoning = '', role = '', finish = null, usage = null, chunks = 0, id = '';
      for await (const ch of s) {
        chunks++;
        id ||= ch.id;
        must(ch.object === 'chat.completion.chunk', `chunk object ${ch.object}`);
        must(ch.id === id, 'every chunk has the same id');
        if (ch.usage) usage = ch.usage;
        for (const c of ch.choices) {
          if (c.delta?.role) role = c.delta.role;
          text += c.delta?.content ?? '';
          reasoning += c.delta?.reasoning ?? c.delta?.reasoning_content ?? '';
          if (c.finish_reason) finish = c.finish_reason;
        }
      }
      must(chunks > 1 && role === 'assistant', `a role chunk, then deltas (${chunks} chunks)`);
      must(finish === 'stop' || finish === 'length', `finish_reason ${finish}`);
      if (includeUsage) must(usage && usage.completion_tokens > 0 && usage.prompt_tokens > 0, 'include_usage: a usage chunk');
      else must(!usage, 'no usage chunk unless asked');
      st.msgs.push({ role: 'assistant', content: text });
      return { text, reasoning, stream: true };
    },
  };
}

const scenarios = [
  {
    // The assistant message is appended exactly as the SDK returned it
    // (with its null refusal, annotations, audio, function_call fields).
    name: 'openai chat', api: 'chat',
    start: () => ({ msgs: [{ role: 'system', content: SYSTEM }] }),
    async turn(sdk, st, i) {
      st.msgs.push({ role: 'user', content: ask('openai chat', i) });
      const { data: r, response } = await sdk.openai.chat.completions.create({ model: opt.model, messages: st.msgs, max_tokens: 24 }).withResponse();
      must(r.object === 'chat.completion' && r.choices.length === 1, 'one chat.completion choice');
      const m = r.choices[0].message;
      must(m.role === 'assistant', `role ${m.role}`);
      must(['stop', 'length'].includes(r.choices[0].finish_reason), `finish_reason ${r.choices[0].finish_reason}`);
      must(r.usage && r.usage.total_tokens === r.usage.prompt_tokens + r.usage.completion_tokens, 'usage adds up');
      must(response.ok, 'withResponse gives the raw response');
      st.msgs.push(m);
      return { text: m.content ?? '', reasoning: m.reasoning ?? m.reasoning_content ?? '' };
    },
  },
  chatStream('openai chat stream usage', true),
  chatStream('openai chat stream no usage', false),
  {
    // The SDK's chat stream helper, which rebuilds the completion from the
    // chunks and checks them.
    name: 'openai chat.completions.stream helper', api: 'chat', stream: true,
    start: () => ({ msgs: [{ role: 'system', content: SYSTEM }] }),
    async turn(sdk, st, i) {
      st.msgs.push({ role: 'user', content: ask('openai chat.completions.stream helper', i) });
      const s = sdk.openai.chat.completions.stream({ model: opt.model, messages: st.msgs, max_tokens: 24, stream_options: { include_usage: true } });
      let deltas = '', reasoning = '';
      s.on('content.delta', (e) => { deltas += e.delta; });
      s.on('chunk', (ch) => { for (const c of ch.choices) reasoning += c.delta?.reasoning ?? c.delta?.reasoning_content ?? ''; });
      const r = await s.finalChatCompletion();
      const m = r.choices[0].message;
      must((m.content ?? '') === deltas, 'the final message is the deltas');
      must(r.usage && r.usage.completion_tokens > 0, 'usage');
      st.msgs.push({ role: 'assistant', content: m.content ?? '' });
      return { text: m.content ?? '', reasoning, stream: true };
    },
  },
  {
    // Tools declared, and a tool call with its result in the history of
    // every turn after the first (the simulator never calls a tool itself).
    name: 'openai chat tools', api: 'chat',
    start: () => ({ msgs: [{ role: 'system', content: SYSTEM }] }),
    async turn(sdk, st, i) {
      if (i > 0) chatToolRound(st.msgs, i);
      st.msgs.push({ role: 'user', content: ask('openai chat tools', i) });
      const r = await sdk.openai.chat.completions.create({ model: opt.model, messages: st.msgs, max_tokens: 24, tools: [shellTool], tool_choice: 'auto', parallel_tool_calls: false });
      const m = r.choices[0].message;
      must(!m.tool_calls || Array.isArray(m.tool_calls), 'tool_calls is absent or a list');
      st.msgs.push(m);
      return { text: m.content ?? '', reasoning: m.reasoning ?? m.reasoning_content ?? '' };
    },
  },
  {
    name: 'openai completions', api: 'completions',
    start: () => ({ prompt: SYSTEM + '\n' }),
    async turn(sdk, st, i) {
      st.prompt += `Q: ${ask('openai completions', i)}\nA:`;
      const r = await sdk.openai.completions.create({ model: opt.model, prompt: st.prompt, max_tokens: 24 });
      must(r.object === 'text_completion' && r.choices.length === 1, 'one text_completion choice');
      const text = r.choices[0].text;
      st.prompt += text + '\n';
      return { text };
    },
  },
  {
    name: 'openai completions stream', api: 'completions', stream: true,
    start: () => ({ prompt: SYSTEM + '\n' }),
    async turn(sdk, st, i) {
      st.prompt += `Q: ${ask('openai completions stream', i)}\nA:`;
      const s = await sdk.openai.completions.create({ model: opt.model, prompt: st.prompt, max_tokens: 24, stream: true });
      let text = '', finish = null;
      for await (const ch of s) {
        for (const c of ch.choices) {
          text += c.text;
          if (c.finish_reason) finish = c.finish_reason;
        }
      }
      must(finish === 'stop' || finish === 'length', `finish_reason ${finish}`);
      st.prompt += text + '\n';
      return { text, stream: true };
    },
  },
  responsesScenario('openai responses', false),
  responsesScenario('openai responses stream', true),
  {
    // The SDK's stream helper (which rebuilds the response from the events
    // and checks their order), the final response's output resent.
    name: 'openai responses.stream helper', api: 'responses', stream: true,
    start: () => ({ input: [] }),
    async turn(sdk, st, i) {
      st.input.push(userItem(ask('openai responses.stream helper', i)));
      const s = sdk.openai.responses.stream(responsesBody(`codex-helper-${nonce}`, st.input));
      let deltas = '';
      s.on('response.output_text.delta', (e) => { deltas += e.delta; });
      const r = await s.finalResponse();
      must(r.status === 'completed' || r.status === 'incomplete', `status ${r.status}`);
      must(r.output_text === deltas, 'output_text equals the deltas');
      st.input.push(...r.output);
      return { text: r.output_text, reasoning: reasoningOf(r.output), stream: true };
    },
  },
  messagesScenario('anthropic messages', { stream: false }),
  messagesScenario('anthropic messages.stream', { stream: true }),
  messagesScenario('anthropic beta.messages', { stream: false, beta: true }),
  messagesScenario('anthropic beta.messages.stream', { stream: true, beta: true }),
];

function userItem(text) {
  return { type: 'message', role: 'user', content: [{ type: 'input_text', text }] };
}

// responsesBody is what Codex CLI sends besides stream.
function responsesBody(session, input) {
  return {
    model: opt.model, instructions: SYSTEM, input, store: false, max_output_tokens: 24,
    tools: [{ type: 'function', name: 'shell', description: 'Runs a shell command.', strict: false, parameters: shellTool.function.parameters }],
    tool_choice: 'auto', parallel_tool_calls: false, reasoning: { effort: 'medium', summary: 'auto' },
    include: ['reasoning.encrypted_content'], prompt_cache_key: session,
  };
}

// Codex: store false, the whole input every turn with the previous output
// items verbatim, then a function call and its output, then the user.
function responsesScenario(name, stream) {
  return {
    name, api: 'responses', stream,
    start: () => ({ input: [] }),
    async turn(sdk, st, i) {
      if (i > 0) {
        st.input.push({ type: 'function_call', call_id: `call_${i}`, name: 'shell', arguments: JSON.stringify({ command: ['go', 'test', `./m${i}/...`] }) });
        st.input.push({ type: 'function_call_output', call_id: `call_${i}`, output: `--- FAIL: TestTurn${i} (0.00s)` });
      }
      st.input.push(userItem(ask(name, i)));
      const body = responsesBody(`${(name + askTag).replaceAll(' ', '-')}-${nonce}`, st.input);
      if (!stream) {
        const r = await sdk.openai.responses.create(body);
        must(r.object === 'response' && r.status !== 'failed', `response status ${r.status}`);
        must(r.usage && r.usage.input_tokens > 0, 'usage.input_tokens');
        st.input.push(...r.output);
        return { text: r.output_text, reasoning: reasoningOf(r.output) };
      }
      const s = await sdk.openai.responses.create({ ...body, stream: true });
      let text = '', completed = null, seq = -1;
      const items = [];
      for await (const ev of s) {
        must(ev.sequence_number > seq, `sequence_number increases (${ev.type})`);
        seq = ev.sequence_number;
        if (ev.type === 'response.output_text.delta') text += ev.delta;
        else if (ev.type === 'response.output_item.done') items.push(ev.item);
        else if (ev.type === 'response.completed') completed = ev.response;
        else if (ev.type === 'response.failed' || ev.type === 'error') throw new Error(`${ev.type} event`);
      }
      must(completed, 'response.completed arrives');
      must(completed.output_text === undefined || completed.output_text === text, 'completed output_text equals the deltas');
      st.input.push(...items); // Codex keeps the output_item.done items
      must(reasoningOf(items) === reasoningOf(completed.output), 'the done items are the completed output');
      return { text, reasoning: reasoningOf(items), stream: true };
    },
  };
}

// Claude Code: system as text blocks with cache_control, tools, thinking,
// the assistant's content blocks echoed, tool_use/tool_result rounds.
function messagesScenario(name, { stream, beta }) {
  const tools = [{ name: 'Bash', description: 'Run a command.', input_schema: { type: 'object', properties: { command: { type: 'string' } }, required: ['command'] } }];
  return {
    name, api: 'messages', stream, beta,
    start: () => ({ msgs: [] }),
    async turn(sdk, st, i) {
      const user = [{ type: 'text', text: ask(name, i) }];
      if (i > 0) {
        const id = `toolu_${i}`;
        st.msgs.push({ role: 'assistant', content: [{ type: 'tool_use', id, name: 'Bash', input: { command: `go test ./m${i}/...` } }] });
        user.unshift({ type: 'tool_result', tool_use_id: id, content: `--- FAIL: TestTurn${i} (0.00s)` });
      }
      st.msgs.push({ role: 'user', content: user });
      const body = {
        model: opt.model, max_tokens: 24, messages: st.msgs, tools,
        system: [{ type: 'text', text: SYSTEM, cache_control: { type: 'ephemeral' } }],
        thinking: beta ? { type: 'enabled', budget_tokens: 1024 } : { type: 'adaptive' },
        metadata: { user_id: `user_check_session_${name.replaceAll(' ', '_')}` },
      };
      let m;
      // Claude Code's path: POST /v1/messages?beta=true with anthropic-beta.
      const betas = ['interleaved-thinking-2025-05-14', 'fine-grained-tool-streaming-2025-05-14'];
      if (beta && stream) {
        // Claude Code's own call: the beta stream helper.
        const s = sdk.anthropic.beta.messages.stream({ ...body, betas }, { query: { beta: 'true' } });
        let deltas = '';
        s.on('text', (t) => { deltas += t; });
        m = await s.finalMessage();
        must(textOf(m) === deltas, 'finalMessage text equals the text deltas');
      } else if (beta) m = await sdk.anthropic.beta.messages.create({ ...body, betas }, { query: { beta: 'true' } });
      else if (stream) {
        const s = sdk.anthropic.messages.stream(body);
        let deltas = '';
        s.on('text', (t) => { deltas += t; });
        m = await s.finalMessage();
        must(textOf(m) === deltas, 'finalMessage text equals the text deltas');
      } else m = await sdk.anthropic.messages.create(body);
      must(Array.isArray(m.content) && m.content.length > 0, 'content blocks');
      must(['end_turn', 'max_tokens', 'stop_sequence', 'tool_use'].includes(m.stop_reason), `stop_reason ${m.stop_reason}`);
      must(m.usage && m.usage.input_tokens > 0 && m.usage.output_tokens > 0, 'usage');
      if (!stream) must(m.type === 'message' && m.role === 'assistant', `type ${m.type} role ${m.role}`);
      st.msgs.push({ role: 'assistant', content: m.content });
      return { text: textOf(m), reasoning: m.content.filter((b) => b.type === 'thinking').map((b) => b.thinking).join(''), stream };
    },
  };
}

// reasoningOf joins the text of the reasoning items of a Responses output.
const reasoningOf = (output) => output.filter((it) => it.type === 'reasoning')
  .map((it) => (it.content ?? []).map((c) => c.text).join('') || (it.summary ?? []).map((c) => c.text).join('')).join('');

const textOf = (m) => m.content.filter((b) => b.type === 'text').map((b) => b.text).join('');

class CheckError extends Error {}
function must(ok, what) {
  if (!ok) throw new CheckError(what);
}

// --- malformed requests: the SDKs' own error classes ------------------------

const errorCases = [
  { name: 'openai chat without messages', run: (s) => s.openai.chat.completions.create({ model: opt.model }), sdk: 'openai' },
  { name: 'openai chat stream without messages', run: async (s) => { for await (const _ of await s.openai.chat.completions.create({ model: opt.model, stream: true })); }, sdk: 'openai' },
  { name: 'openai completions without prompt', run: (s) => s.openai.completions.create({ model: opt.model, max_tokens: 4 }), sdk: 'openai' },
  { name: 'openai responses without input', run: (s) => s.openai.responses.create({ model: opt.model, store: false }), sdk: 'openai' },
  { name: 'openai responses previous_response_id', run: (s) => s.openai.responses.create({ model: opt.model, input: 'hi', previous_response_id: 'resp_1' }), sdk: 'openai' },
  { name: 'anthropic messages without max_tokens', run: (s) => s.anthropic.messages.create({ model: opt.model, messages: [{ role: 'user', content: 'hi' }] }), sdk: 'anthropic' },
  { name: 'anthropic messages.stream without max_tokens', run: (s) => s.anthropic.messages.stream({ model: opt.model, messages: [{ role: 'user', content: 'hi' }] }).finalMessage(), sdk: 'anthropic' },
  { name: 'anthropic beta.messages without messages', run: (s) => s.anthropic.beta.messages.create({ model: opt.model, max_tokens: 4, betas: ['interleaved-thinking-2025-05-14'] }, { query: { beta: 'true' } }), sdk: 'anthropic' },
];

async function checkError(sdk, rec, c) {
  const Cls = c.sdk === 'openai' ? OpenAI.BadRequestError : Anthropic.BadRequestError;
  const n = rec.log.length;
  try {
    await c.run(sdk);
  } catch (e) {
    must(e instanceof Cls, `${c.sdk} BadRequestError, got ${e?.constructor?.name}: ${e?.message}`);
    must(e.status === 400, `status ${e.status}`);
    const raw = await rec.log.at(-1)?.raw;
    must(rec.log.length === n + 1, 'one request, no retry');
    must(/^application\/json/.test(rec.log.at(-1).headers.get('content-type') ?? ''), 'error content-type application/json');
    for (const w of HANDLE_WORDS) must(!raw.includes(w), `no ${w}`);
    if (c.sdk === 'openai') {
      must(typeof e.error?.message === 'string' && e.error.message.length > 0, 'error.message parsed');
      must(e.error.type === 'invalid_request_error', `error.type ${e.error.type}`);
      must(e.message.includes(e.error.message), 'the SDK message names it');
    } else {
      must(e.error?.type === 'error', `body type ${e.error?.type}`);
      must(e.error.error?.type === 'invalid_request_error', `error.type ${e.error.error?.type}`);
      must(typeof e.error.error.message === 'string' && e.error.error.message.length > 0, 'error.message parsed');
    }
    return e.error?.message ?? e.error?.error?.message;
  }
  throw new CheckError('no error raised');
}

// --- the run ----------------------------------------------------------------

// checkExchange checks the raw bytes and headers of one turn's exchange.
async function checkExchange(ex, sc, stream, wantReuse, run) {
  must(ex.status === 200, `status ${ex.status}`);
  const raw = await ex.raw;
  for (const w of HANDLE_WORDS) must(!raw.includes(w), `no ${w} in the response`);
  const ct = ex.headers.get('content-type') ?? '';
  if (stream) {
    must(/^text\/event-stream/.test(ct), `content-type ${ct}`);
    checkSSE(raw, sc.api);
  } else {
    must(/^application\/json/.test(ct), `content-type ${ct}`);
  }
  if (sc.beta) must(new URL(ex.url).search === '?beta=true', `beta path ${ex.url}`);
  must(/^[!-~]{1,128}$/.test(ex.headers.get('x-request-id') ?? ''), 'an X-Request-Id (the SDKs report it)');
  // "local" (the proxy's --decode-local: the decode engine computed the
  // turn from its own prefix cache) is reuse too.
  const header = ex.headers.get('x-bidikv-reuse');
  must(['hit', 'miss', 'local'].includes(header), `X-Bidikv-Reuse ${header}`);
  const reuse = header === 'local' ? 'hit' : header;
  if (wantReuse && (run === 0 || wantReuse === 'hit')) must(reuse === wantReuse, `X-Bidikv-Reuse ${header}, want ${wantReuse}`);
  return reuse;
}

// checkSSE checks the framing: chat and completions streams are data-only
// events ending with data: [DONE]; Responses and Messages streams name each
// event with the type its data carries.
function checkSSE(raw, api) {
  const events = raw.replace(/\r\n?/g, '\n').split('\n\n').filter((e) => e.trim() !== '');
  must(events.length > 1, 'several events');
  events.forEach((ev, k) => {
    const fields = Object.fromEntries(ev.split('\n').filter((l) => !l.startsWith(':')).map((l) => {
      const j = l.indexOf(':');
      return [l.slice(0, j), l.slice(j + 1).replace(/^ /, '')];
    }));
    must('data' in fields, `event ${k} has data`);
    if (api === 'chat' || api === 'completions') {
      if (k === events.length - 1) must(fields.data === '[DONE]', 'ends with data: [DONE]');
      else JSON.parse(fields.data);
      return;
    }
    const d = JSON.parse(fields.data);
    must(fields.event === d.type, `event: ${fields.event} names data.type ${d.type}`);
  });
}

// Calls besides turns: the model list through each SDK, Anthropic's token
// count (Claude Code asks it before long requests) and, when the proxy
// takes keys, a wrong key answered with each SDK's AuthenticationError.
const otherCases = [
  {
    name: 'openai models.list', async run(sdk) {
      const ids = [];
      for await (const m of sdk.openai.models.list()) ids.push(m.id);
      must(ids.includes(opt.model), `models ${ids.join(',')} include ${opt.model}`);
    },
  },
  {
    name: 'anthropic messages.countTokens', async run(sdk, rec) {
      const r = await sdk.anthropic.messages.countTokens({ model: opt.model, system: [{ type: 'text', text: SYSTEM }], messages: [{ role: 'user', content: ask('count', 0) }] });
      must(Number.isInteger(r.input_tokens) && r.input_tokens > 0, `input_tokens ${r.input_tokens}`);
      must(/^application\/json/.test(rec.log.at(-1).headers.get('content-type') ?? ''), 'content-type application/json');
    },
  },
  {
    // Claude Code and older Anthropic SDKs send the key as X-Api-Key.
    name: 'anthropic X-Api-Key header', needsKey: true, async run(_, rec) {
      const c = new Anthropic({ apiKey: null, authToken: null, baseURL: opt.base, maxRetries: 0, fetch: rec.fetchFn, defaultHeaders: { 'X-Api-Key': opt.apiKey } });
      const m = await c.messages.create({ model: opt.model, max_tokens: 2, messages: [{ role: 'user', content: 'hi' }] });
      must(m.type === 'message' && textOf(m).length > 0, 'a message');
    },
  },
  {
    name: 'openai wrong key', needsKey: true, async run(_, rec) {
      const bad = clients(opt.base, rec, 'sk-wrong');
      const e = await bad.openai.chat.completions.create({ model: opt.model, messages: [{ role: 'user', content: 'hi' }], max_tokens: 2 }).then(() => null, (e) => e);
      must(e instanceof OpenAI.AuthenticationError && e.status === 401, `AuthenticationError 401, got ${e?.constructor?.name} ${e?.status}`);
      must(e.error?.type === 'authentication_error' && typeof e.error.message === 'string', `OpenAI error shape ${JSON.stringify(e.error)}`);
    },
  },
  {
    name: 'anthropic wrong key', needsKey: true, async run(_, rec) {
      const bad = clients(opt.base, rec, 'sk-wrong');
      const e = await bad.anthropic.messages.create({ model: opt.model, max_tokens: 2, messages: [{ role: 'user', content: 'hi' }] }).then(() => null, (e) => e);
      must(e instanceof Anthropic.AuthenticationError && e.status === 401, `AuthenticationError 401, got ${e?.constructor?.name} ${e?.status}`);
      must(e.error?.type === 'error' && e.error.error?.type === 'authentication_error' && typeof e.error.error.message === 'string', `Anthropic error shape ${JSON.stringify(e.error)}`);
      must(e.requestID, 'request-id reaches the SDK (error.requestID)');
    },
  },
];

// keyClients are the two SDKs sending key in one header: 'bearer'
// (Authorization: Bearer, as both SDKs send their apiKey) or 'x-api-key'
// (as Claude Code and older Anthropic SDKs send it: the SDKs' own
// Authorization left out, the key in X-Api-Key).
function keyClients(rec, key, header) {
  const common = { baseURL: opt.base, maxRetries: 0, timeout: 60_000, fetch: rec.fetchFn };
  if (header === 'bearer') {
    return {
      openai: new OpenAI({ ...common, apiKey: key, baseURL: opt.base + '/v1' }),
      anthropic: new Anthropic({ ...common, apiKey: key }),
    };
  }
  return {
    openai: new OpenAI({ ...common, apiKey: key, baseURL: opt.base + '/v1', defaultHeaders: { Authorization: null, 'X-Api-Key': key } }),
    anthropic: new Anthropic({ ...common, apiKey: null, authToken: null, defaultHeaders: { 'X-Api-Key': key } }),
  };
}

// sentKey returns the header that carried the key of a recorded request.
function sentKey(ex) {
  const h = new Headers(ex.init?.headers ?? {});
  return h.get('authorization') ? 'bearer' + (h.get('x-api-key') ? '+x-api-key' : '') : h.get('x-api-key') ? 'x-api-key' : 'none';
}

// tenantCases: tenant A (--api-key) has turn 1 of a conversation on each
// API; tenant B (--second-key) resends A's exact history with turn 2, its
// key in the header A used; then A sends the same turn 2 with its key in
// the other header. B must miss, A must hit, and both get the same answer.
async function tenantCases() {
  const rows = [];
  const names = ['openai chat', 'openai completions', 'openai responses', 'anthropic messages'];
  const headers = [['bearer', 'x-api-key'], ['x-api-key', 'bearer']];
  for (const sc of scenarios.filter((s) => names.includes(s.name))) {
    for (const [aHeader, bHeader] of headers) {
      const rec = recorder();
      const row = { scenario: `tenant: ${sc.name} a and b by ${aHeader}, a again by ${bHeader}`, turns: 0, hits: 0, errors: 0, texts: [], failures: [] };
      askTag = ` tenant ${aHeader}`;
      try {
        const a = keyClients(rec, opt.apiKey, aHeader), a2 = keyClients(rec, opt.apiKey, bHeader), b = keyClients(rec, opt.secondKey, aHeader);
        const st = sc.start();
        await sc.turn(a, st, 0);
        must(sentKey(rec.log.at(-1)) === aHeader, `a's key sent as ${aHeader}, got ${sentKey(rec.log.at(-1))}`);
        await checkExchange(rec.log.at(-1), sc, false, 'miss', 0);
        const stB = structuredClone(st);
        const gotB = await sc.turn(b, stB, 1);
        must(sentKey(rec.log.at(-1)) === aHeader, `b's key sent as ${aHeader}, got ${sentKey(rec.log.at(-1))}`);
        const reuseB = await checkExchange(rec.log.at(-1), sc, false, 'miss', 0);
        const gotA = await sc.turn(a2, st, 1);
        must(sentKey(rec.log.at(-1)) === bHeader, `a's key sent as ${bHeader} the second time, got ${sentKey(rec.log.at(-1))}`);
        const reuseA = await checkExchange(rec.log.at(-1), sc, false, 'hit', 0);
        must(gotA.text === gotB.text, 'the same history, the same answer');
        row.turns = 3;
        row.hits = [reuseB, reuseA].filter((r) => r === 'hit').length;
      } catch (e) {
        row.errors++;
        row.failures.push(`${e instanceof CheckError ? '' : (e?.constructor?.name ?? 'Error') + ': '}${e?.message ?? e}`);
      }
      askTag = '';
      rows.push(row);
    }
  }
  return rows;
}

async function runSuite(run, ref) {
  const rows = [];
  for (const sc of scenarios) {
    const rec = recorder();
    const sdk = clients(opt.base, rec);
    const refRec = ref ? recorder() : null;
    const refSdk = ref ? clients(ref, refRec) : null;
    // A buffered stream is the decode engine's non-streamed answer written
    // as the API's stream, so its reference is the engine's non-streamed
    // answer: the two differ where vLLM's stream and body do, a tool call
    // cut by max_tokens (a stream has sent its name and arguments so far,
    // a body leaves it out). Messages streams are buffered from turn 1;
    // the chat and completions streams here declare no tools.
    const refSc = opt.buffered && sc.api === 'messages' && sc.stream ? messagesScenario(sc.name, { stream: false, beta: sc.beta }) : sc;
    const st = sc.start();
    const refSt = ref ? refSc.start() : null;
    const row = { scenario: sc.name, turns: 0, hits: 0, errors: 0, texts: [], failures: [] };
    for (let i = 0; i < opt.turns; i++) {
      try {
        const n = rec.log.length;
        const got = await sc.turn(sdk, st, i);
        must(rec.log.length === n + 1, `one request per turn, got ${rec.log.length - n}`);
        const reuse = await checkExchange(rec.log.at(-1), sc, got.stream, expectReuse(sc, i, run), run);
        must(got.text.length > 0, 'non-empty text');
        if (ref) {
          const want = await refSc.turn(refSdk, refSt, i);
          must(got.text === want.text, `text equals the reference engine's: got ${JSON.stringify(got.text)}, want ${JSON.stringify(want.text)}`);
          must((got.reasoning ?? '') === (want.reasoning ?? ''), `reasoning equals the reference engine's: got ${JSON.stringify(got.reasoning)}, want ${JSON.stringify(want.reasoning)}`);
        }
        row.turns++;
        if (reuse === 'hit') row.hits++;
        row.texts.push(got.text + '\u0000' + (got.reasoning ?? ''));
        if (got.reasoning) row.reasoning = (row.reasoning ?? 0) + 1;
      } catch (e) {
        row.errors++;
        row.failures.push(`turn ${i + 1}: ${e instanceof CheckError ? '' : (e?.constructor?.name ?? 'Error') + ': '}${e?.message ?? e}`);
        break; // the history is broken: the later turns would only repeat it
      }
    }
    rows.push(row);
  }
  const rec = recorder();
  const sdk = clients(opt.base, rec);
  for (const c of errorCases) {
    const row = { scenario: `error: ${c.name}`, turns: 1, hits: 0, errors: 0, texts: [], failures: [] };
    try {
      row.message = await checkError(sdk, rec, c);
    } catch (e) {
      row.errors++;
      row.failures.push(e?.message ?? String(e));
    }
    rows.push(row);
  }
  if (opt.secondKey && run === 0) rows.push(...await tenantCases());
  for (const c of otherCases) {
    if (c.needsKey && !opt.apiKey) continue;
    const row = { scenario: c.name, turns: 1, hits: 0, errors: 0, texts: [], failures: [] };
    try {
      await c.run(sdk, rec);
    } catch (e) {
      row.errors++;
      row.failures.push(`${e instanceof CheckError ? '' : (e?.constructor?.name ?? 'Error') + ': '}${e?.message ?? e}`);
    }
    rows.push(row);
  }
  return rows;
}

const runs = [await runSuite(0, opt.reference)];
if (!opt.reference) {
  // Determinism: the same conversations again, text for text.
  const again = await runSuite(1, '');
  again.forEach((row, k) => {
    const first = runs[0][k];
    row.texts.forEach((t, i) => {
      if (first.texts[i] !== undefined && first.texts[i] !== t) {
        row.errors++;
        row.failures.push(`turn ${i + 1}: differs from the first run: ${JSON.stringify(t)} vs ${JSON.stringify(first.texts[i])}`);
      }
    });
  });
  runs.push(again);
}

const versions = { openai: OpenAI.VERSION ?? (await import('openai/version').then((m) => m.VERSION).catch(() => '?')), anthropic: Anthropic.VERSION ?? (await import('@anthropic-ai/sdk/version').then((m) => m.VERSION).catch(() => '?')), node: process.version };
let failed = 0;
const table = [];
runs.forEach((rows, r) => rows.forEach((row) => {
  failed += row.errors;
  table.push({ run: r + 1, ...row });
}));
if (opt.json) {
  console.log(JSON.stringify({ versions, reference: opt.reference || null, failed, rows: table.map(({ texts, ...r }) => r) }, null, 1));
} else {
  console.log(`openai ${versions.openai}, @anthropic-ai/sdk ${versions.anthropic}, node ${versions.node}; ${opt.turns} turns; ` +
    (opt.reference ? `reference ${opt.reference}` : 'two identical runs compared'));
  const w = Math.max(...table.map((t) => t.scenario.length));
  console.log(`run  ${'scenario'.padEnd(w)}  turns  hits  errors`);
  for (const t of table) {
    console.log(`${String(t.run).padEnd(3)}  ${t.scenario.padEnd(w)}  ${String(t.turns).padStart(5)}  ${String(t.hits).padStart(4)}  ${String(t.errors).padStart(6)}`);
    for (const f of t.failures) console.log(`     FAIL ${f}`);
  }
  const sum = (k) => table.reduce((a, t) => a + t[k], 0);
  console.log(`total: ${sum('turns')} turns, ${sum('hits')} hits, ${failed} errors`);
}
process.exit(failed > 0 ? 1 : 0);
