"""The Anthropic Messages API over the cached sessions (`/v1/messages`, `/v1/messages/count_tokens`)."""
