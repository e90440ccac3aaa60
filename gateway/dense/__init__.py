"""Dense next-token rows: everything between the route and the engine, one way down.

service.py        DenseService.answer: a request's rows and its answer's bytes
engine_calls.py   a request's rows asked of the engine, at most max_batch_rows distinct a call
row_cache.py      the output cache: MemoryRowCache (in process) or RedisRowCache (shared)
redis_store.py    Redis with timeouts and a circuit breaker
quiet_time.py     when deferred cache stores run
delivery.py       the answer in the body (JSON, MessagePack) or in the client's shared memory
shared_memory.py  clients' segments, mapped and checked
parallel_copy.py  large copies on several threads
"""
