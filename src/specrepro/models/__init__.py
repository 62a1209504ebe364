"""Model loading: hub ids, local paths, the embedded SmolLM2 GGUF, tiny random LLaMAs."""

from specrepro.models.loading import LoadedModel, ModelLoader, load_model, resolve_device, resolve_dtype, use_hardware

__all__ = ["LoadedModel", "ModelLoader", "load_model", "resolve_device", "resolve_dtype", "use_hardware"]
