"""Dense next-token rows: everything between the route and the engine, one way down.

service.py        DenseService.answer: a request's rows and its answer's bytes; DenseService.logprobs
row_cache.py      the output cache (RowCache.fill): MemoryRowCache (in process) or RedisRowCache (shared)
engine_calls.py   a request's engine calls, counted and timed, at most max_batch_rows distinct rows each
redis_store.py    Redis with timeouts and a circuit breaker
quiet_time.py     when deferred cache stores run
delivery.py       the answer in the body (JSON, MessagePack) or in the client's shared memory
shared_memory.py  clients' segments, mapped and checked
parallel_copy.py  large copies on several threads
"""
