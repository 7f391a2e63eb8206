"""What clients talk to: the server on one port, the websocket gateway and the OpenAI-compatible API,
their message schemas, authentication, rate limits and turn logs. Imports the engine, never the reverse."""
