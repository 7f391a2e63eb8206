// A four-turn support conversation with a tool round through Vercel's AI SDK, pointed at chatd (only the base URL
// changed): `openai(model)` (the Responses API, `store` on: later turns refer to earlier replies by item id) or
// `anthropic(model)` (no maxOutputTokens: the SDK sends its own default). Prints each turn as JSON lines.
import { createAnthropic } from '@ai-sdk/anthropic';
import { createOpenAI } from '@ai-sdk/openai';
import { generateText, stepCountIs, tool } from 'ai';
import { z } from 'zod';

const [provider, baseURL, modelName] = process.argv.slice(2);
const model = provider === 'anthropic'
  ? createAnthropic({ baseURL, apiKey: 'unused' })(modelName)
  : createOpenAI({ baseURL, apiKey: 'unused' })(modelName);
const tools = {
  lookup_order: tool({
    description: 'Find an order by its id.',
    inputSchema: z.object({ order: z.string() }),
    execute: async ({ order }) => ({ order, status: 'lost in transit' }),
  }),
};
const questions = ['Where is my order NW-2231?', 'When was it sent?', 'Can you refund it?', 'Thanks, goodbye.'];
const messages = [];
for (const [index, question] of questions.entries()) {
  messages.push({ role: 'user', content: question });
  const result = await generateText({
    model, tools, messages, temperature: 0,
    system: 'You are the support desk of a small internet provider. Answer briefly.',
    stopWhen: stepCountIs(2),
    // The first question's first step must look the order up; every other step answers in words.
    prepareStep: ({ stepNumber }) => ({ toolChoice: index === 0 && stepNumber === 0 ? 'required' : 'none' }),
    ...(provider === 'anthropic' ? { providerOptions: { anthropic: { disableParallelToolUse: true } } }
      : { maxOutputTokens: 48, providerOptions: { openai: { parallelToolCalls: false } } }),
  });
  messages.push(...result.response.messages);
  console.log(JSON.stringify({
    turn: index + 1,
    text: result.text,
    calls: result.steps.flatMap((step) => step.toolCalls.map((call) => call.toolName)),
    finish: result.finishReason,
    usage: result.usage,  // the last step's: this turn's request
  }));
}
