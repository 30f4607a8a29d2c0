"""tidal's embedded inference engine: transformers' model classes, its own KV cache and continuous batching,
served over SGLang's HTTP protocol (``tidal serve``)."""
