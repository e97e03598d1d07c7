"""The paged-KV engine: block manager, scheduler, model runner, models, sampler."""
