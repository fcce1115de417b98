"""flashcodec codecs inside other engines' KV memory.

:mod:`flashcodec.integrations.kv_pages` (torch only): K/V between paged-engine pages and
flashcodec's codes. :mod:`flashcodec.integrations.vllm_connector`: a vLLM KV connector that
offloads a request's prefix pages through those codes; it imports vLLM, which flashcodec does not
depend on (install vLLM yourself; importing this package imports neither module).
"""
