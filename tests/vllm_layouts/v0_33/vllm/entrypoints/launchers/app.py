# mirrors vllm/entrypoints/launchers/app.py (the OpenAI server's FastAPI app)
def build_app(args, supported_tasks=None, model_config=None):
    return None
