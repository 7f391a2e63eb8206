"""chatd's own websocket protocol (`/ws`): its messages, the gateway over the turn runner, the turn log that resumes a
stream on another connection, and the socket the server hands it."""
