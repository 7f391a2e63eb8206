"""The OpenAI-compatible surfaces: chat completions, the Responses and Conversations APIs, their bodies,
and tools as each model renders and writes them."""
