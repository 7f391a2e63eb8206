"""What operators see: Prometheus metrics and the rolling stats behind /v1/stats and the dashboard."""
