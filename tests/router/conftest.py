"""The router tests share the services' fixtures: a throwaway redis-server."""

from tests.services.conftest import redis_server  # noqa: F401 - a fixture, used by name
