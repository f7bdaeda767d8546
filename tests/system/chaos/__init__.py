"""Chaos run: worker and relay processes killed at random on real RabbitMQ and PostgreSQL."""
