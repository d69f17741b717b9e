"""Prometheus and OpenTelemetry exporters (RecordSinks); not built yet."""
