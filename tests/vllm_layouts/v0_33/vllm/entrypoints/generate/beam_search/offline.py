# mirrors vllm/entrypoints/generate/beam_search/offline.py (LLM.beam_search)
class BeamSearchOfflineMixin:
    def beam_search(self, prompts, params, lora_request=None, use_tqdm=False, concurrency_limit=None, priority=None):
        return []

    def _beam_search_step(self, instances_batch, base_sampling_params, eos_token_ids, ignore_eos, beam_width,
                          sort_beams_key, structured_output_backend, structured_output_key,
                          structured_output_bitmask):
        return True
