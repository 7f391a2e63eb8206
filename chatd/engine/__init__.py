"""All model work, in one thread: the scheduler, a turn's state between steps, forward passes over the
KV arena, sampling and streamed text, and the deep check. Imports the model layer and the cache store."""
