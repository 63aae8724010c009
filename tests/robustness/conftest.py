from tests.redis_server import redis_key_prefix, redis_url  # noqa: F401
