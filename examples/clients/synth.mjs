#!/usr/bin/env node
// synth.mjs checks that the official OpenAI and Anthropic SDKs, unmodified,
// parse the streams bidikv synthesizes from a non-streaming answer
// (--decode-stream buffered, package internal/streamsynth) exactly as they
// parse the answer itself. It is driven by internal/streamsynth's
// TestOfficialSDKs, which serves, for each case, the answer as JSON to a
// request without "stream" and the synthesized stream to one with it:
//
//   node synth.mjs <server-base-url> [--json]
//
// For each case it asks for the answer without streaming, then through
// the SDKs' stream helpers (OpenAI chat.completions.stream() and
// finalChatCompletion(); Anthropic messages.stream() and
// beta.messages.stream(), as Claude Code streams, with finalMessage(),
// tool_use input parsed by the SDK) and by iterating create({stream:
// true}) as agents do, and checks every reassembled answer equals the
// non-streaming one. Exits 1 on any failure.
import OpenAI from 'openai';
import Anthropic from '@anthropic-ai/sdk';

const args = process.argv.slice(2);
const base = (args.find((a) => !a.startsWith('--')) ?? '').replace(/\/+$/, '');
const asJSON = args.includes('--json');
if (!base) {
  console.error('usage: node synth.mjs <server-base-url> [--json]');
  process.exit(2);
}

// canon is JSON with sorted keys and no undefined members: the form both
// sides are compared in.
function canon(v) {
  if (Array.isArray(v)) return v.map(canon);
  if (v && typeof v === 'object') {
    const out = {};
    for (const k of Object.keys(v).sort()) if (v[k] !== undefined) out[k] = canon(v[k]);
    return out;
  }
  return v;
}
const same = (a, b) => JSON.stringify(canon(a)) === JSON.stringify(canon(b));

// What a chat client keeps of a choice: vLLM's first chunk carries
// content "", so a null content reads as ""; an empty reasoning or tool
// call list as none.
function chatChoice(c) {
  const m = c.message ?? {};
  const out = { index: c.index, finish_reason: c.finish_reason, role: m.role, content: m.content ?? '', logprobs: c.logprobs ?? null };
  for (const k of ['reasoning', 'reasoning_content']) if (m[k]) out[k] = m[k];
  if (m.tool_calls?.length) {
    out.tool_calls = m.tool_calls.map((t) => ({ id: t.id, type: t.type ?? 'function', function: { name: t.function.name, arguments: t.function.arguments ?? '' } }));
  }
  return out;
}
function chatView(r, includeUsage) {
  const v = { id: r.id, model: r.model, created: r.created, choices: [...r.choices].sort((a, b) => a.index - b.index).map(chatChoice) };
  if (includeUsage && r.usage) v.usage = r.usage;
  return v;
}

// What a Messages client keeps: the message, with the members a stream
// always sets.
function messageView(m) {
  const v = { ...m, stop_reason: m.stop_reason ?? null, stop_sequence: m.stop_sequence ?? null, usage: { input_tokens: 0, output_tokens: 0, ...(m.usage ?? {}) } };
  delete v.parsed_output; // the stream helper's own, always null here
  delete v.kv_transfer_params;
  return v;
}

// reassembleChat iterates create({stream: true}) as agents do.
async function reassembleChat(stream) {
  const r = { choices: [] };
  for await (const ch of stream) {
    r.id ??= ch.id; r.model ??= ch.model; r.created ??= ch.created;
    if (ch.usage && ch.choices.length === 0) r.usage = ch.usage;
    for (const c of ch.choices) {
      const a = (r.choices[c.index] ??= { index: c.index, message: {}, logprobs: null, finish_reason: null });
      const d = c.delta ?? {};
      if (d.role) a.message.role = d.role;
      for (const k of ['content', 'reasoning', 'reasoning_content']) if (typeof d[k] === 'string') a.message[k] = (a.message[k] ?? '') + d[k];
      for (const t of d.tool_calls ?? []) {
        const tc = ((a.message.tool_calls ??= [])[t.index] ??= { function: { name: '', arguments: '' } });
        if (t.id) tc.id = t.id;
        if (t.type) tc.type = t.type;
        if (t.function?.name) tc.function.name = t.function.name;
        tc.function.arguments += t.function?.arguments ?? '';
      }
      if (c.logprobs) a.logprobs = c.logprobs;
      if (c.finish_reason) a.finish_reason = c.finish_reason;
    }
  }
  r.choices = r.choices.filter(Boolean);
  return r;
}

const rows = [];
const cases = await (await fetch(base + '/cases')).json();
for (const c of cases) {
  const row = { name: c.name, api: c.api, checks: 0, failures: [] };
  rows.push(row);
  const check = (ok, what, got, want) => {
    row.checks++;
    if (!ok) row.failures.push(`${what}: got ${JSON.stringify(canon(got))}, want ${JSON.stringify(canon(want))}`);
  };
  const openai = new OpenAI({ apiKey: 'sk-synth', baseURL: `${base}/case/${c.id}/v1`, maxRetries: 0, timeout: 30_000 });
  const anthropic = new Anthropic({ apiKey: 'sk-synth', baseURL: `${base}/case/${c.id}`, maxRetries: 0, timeout: 30_000 });
  try {
    if (c.api === 'chat') {
      const params = { model: 'm', messages: [{ role: 'user', content: 'go' }], tools: [{ type: 'function', function: { name: 'ls', parameters: { type: 'object' } } }] };
      const so = { stream_options: { include_usage: c.includeUsage } };
      const ref = chatView(await openai.chat.completions.create(params), c.includeUsage);
      const helper = openai.chat.completions.stream({ ...params, ...so });
      const final = chatView(await helper.finalChatCompletion(), c.includeUsage);
      check(same(final, ref), 'chat.completions.stream().finalChatCompletion()', final, ref);
      const iter = chatView(await reassembleChat(await openai.chat.completions.create({ ...params, ...so, stream: true })), c.includeUsage);
      check(same(iter, ref), 'for await of chat.completions.create({stream: true})', iter, ref);
    } else if (c.api === 'completions') {
      const params = { model: 'm', prompt: 'go' };
      const ref = await openai.completions.create(params);
      const got = { choices: [] };
      for await (const ch of await openai.completions.create({ ...params, stream: true, stream_options: { include_usage: c.includeUsage } })) {
        got.id ??= ch.id;
        if (ch.usage && ch.choices.length === 0) got.usage = ch.usage;
        for (const x of ch.choices) {
          const a = (got.choices[x.index] ??= { index: x.index, text: '', finish_reason: null });
          a.text += x.text;
          if (x.finish_reason) a.finish_reason = x.finish_reason;
        }
      }
      const view = (r) => ({ id: r.id, usage: c.includeUsage ? r.usage : undefined, choices: r.choices.filter(Boolean).map((x) => ({ index: x.index, text: x.text ?? '', finish_reason: x.finish_reason ?? 'stop' })).sort((a, b) => a.index - b.index) });
      check(same(view(got), view(ref)), 'for await of completions.create({stream: true})', view(got), view(ref));
    } else {
      const params = { model: 'm', max_tokens: 1024, messages: [{ role: 'user', content: 'go' }], tools: [{ name: 'Bash', input_schema: { type: 'object' } }] };
      const ref = messageView(await anthropic.messages.create(params));
      const helper = anthropic.messages.stream(params);
      let text = '';
      helper.on('text', (t) => { text += t; });
      const final = messageView(await helper.finalMessage());
      check(same(final, ref), 'messages.stream().finalMessage()', final, ref);
      const wantText = ref.content.filter((b) => b.type === 'text').map((b) => b.text).join('');
      check(text === wantText, "messages.stream().on('text')", text, wantText);
      // Claude Code's way: the beta client (/v1/messages?beta=true).
      const beta = messageView(await anthropic.beta.messages.stream(params).finalMessage());
      check(same(beta, ref), 'beta.messages.stream().finalMessage()', beta, ref);
      const types = [];
      let iterText = '';
      for await (const ev of await anthropic.messages.create({ ...params, stream: true })) {
        types.push(ev.type);
        if (ev.type === 'content_block_delta' && ev.delta.type === 'text_delta') iterText += ev.delta.text;
      }
      check(types[0] === 'message_start' && types.at(-1) === 'message_stop' && types.at(-2) === 'message_delta', 'event order of messages.create({stream: true})', types, 'message_start … message_delta, message_stop');
      check(iterText === wantText, 'text of messages.create({stream: true})', iterText, wantText);
    }
  } catch (e) {
    row.failures.push(`${e?.constructor?.name ?? 'Error'}: ${e?.message ?? e}`);
  }
}

const report = {
  versions: { openai: OpenAI.VERSION ?? (await import('openai/version').then((m) => m.VERSION).catch(() => '?')), anthropic: Anthropic.VERSION ?? (await import('@anthropic-ai/sdk/version').then((m) => m.VERSION).catch(() => '?')), node: process.version },
  failed: rows.filter((r) => r.failures.length > 0).length,
  rows,
};
if (asJSON) {
  console.log(JSON.stringify(report));
} else {
  for (const r of rows) console.log(`${r.failures.length ? 'FAIL' : 'ok  '} ${r.api.padEnd(11)} ${r.name} (${r.checks} checks)${r.failures.map((f) => '\n     ' + f).join('')}`);
  console.log(`openai ${report.versions.openai}, @anthropic-ai/sdk ${report.versions.anthropic}, node ${report.versions.node}: ${rows.length - report.failed} of ${rows.length} cases parse unchanged`);
}
process.exit(report.failed ? 1 : 0);
