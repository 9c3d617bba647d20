"""SDXL's frozen encoders: both text encoders and the VAE, loaded once and used for caching."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from diffusers import AutoencoderKL
from transformers import CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

from .single_file import SDXL_CONFIG_SOURCE, config_source, is_single_file, load_pipeline
from .tiny_model import TEXT_MAX_LENGTH


def _config_json(model_name_or_path: str, subfolder: str) -> dict:
    """A component's config.json from a local folder or the Hugging Face cache/hub."""
    local = Path(model_name_or_path) / subfolder / "config.json"
    if local.exists():
        return json.loads(local.read_text(encoding="utf-8"))
    from huggingface_hub import hf_hub_download

    return json.loads(Path(hf_hub_download(model_name_or_path, "config.json", subfolder=subfolder)).read_text(encoding="utf-8"))


def model_fingerprint(model_name_or_path: str, vae_name_or_path: str | None = None, single_file_config: str = SDXL_CONFIG_SOURCE) -> str:
    """Short hash of the VAE and text-encoder architectures: it tells SDXL from another model family
    (a cache made with one cannot train the other) without reading any weights. A single-file model's
    architecture is the one its diffusers config describes."""
    model_name_or_path = config_source(model_name_or_path, single_file_config)
    parts = [
        _config_json(vae_name_or_path or model_name_or_path, "" if vae_name_or_path else "vae"),
        _config_json(model_name_or_path, "text_encoder"),
        _config_json(model_name_or_path, "text_encoder_2"),
    ]
    architecture_keys = ("latent_channels", "block_out_channels", "hidden_size", "num_hidden_layers", "projection_dim")
    reduced = [{key: part.get(key) for key in architecture_keys} for part in parts]
    return hashlib.sha256(json.dumps(reduced, sort_keys=True).encode()).hexdigest()[:16]


@dataclass
class Encoders:
    tokenizers: tuple[CLIPTokenizer, CLIPTokenizer]
    text_encoders: tuple[CLIPTextModel, CLIPTextModelWithProjection]
    vae: AutoencoderKL
    device: torch.device
    dtype: torch.dtype

    @property
    def latent_scaling_factor(self) -> float:
        return float(self.vae.config.scaling_factor)

    @torch.no_grad()
    def encode_captions(self, captions: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """Captions -> (prompt_embeds (N, 77, 2048), pooled_prompt_embeds (N, 1280)) as SDXL conditions on:
        the penultimate hidden states of both encoders side by side, and encoder 2's pooled projection.
        Captions longer than 77 tokens are truncated, as in SDXL's own training."""
        hidden_states = []
        pooled = None
        for tokenizer, encoder in zip(self.tokenizers, self.text_encoders):
            token_ids = tokenizer(
                captions, padding="max_length", max_length=TEXT_MAX_LENGTH, truncation=True, return_tensors="pt"
            ).input_ids.to(self.device)
            output = encoder(token_ids, output_hidden_states=True)
            hidden_states.append(output.hidden_states[-2])
            pooled = output[0]  # text_embeds of CLIPTextModelWithProjection (the last encoder)
        return torch.cat(hidden_states, dim=-1).float().cpu(), pooled.float().cpu()

    @torch.no_grad()
    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor:
        """(N, 3, H, W) in [-1, 1] -> scaled latents (N, 4, H/8, W/8). The distribution's mean is used,
        so the cache is deterministic (SDXL's VAE posterior std is tiny next to the mean)."""
        posterior = self.vae.encode(pixels.to(self.device, self.vae.dtype)).latent_dist
        return (posterior.mean.float() * self.latent_scaling_factor).cpu()


def load_encoders(
    model_name_or_path: str,
    vae_name_or_path: str | None,
    device: torch.device,
    dtype: torch.dtype,
    single_file_config: str = SDXL_CONFIG_SOURCE,
    vae_dtype: torch.dtype = torch.float32,
) -> Encoders:
    """Load both tokenizers and text encoders (in `dtype`) and the VAE or a replacement VAE (in `vae_dtype`)
    for inference, from a diffusers folder / hub id or a single-file checkpoint."""
    if is_single_file(model_name_or_path):
        pipeline = load_pipeline(model_name_or_path, single_file_config, torch.float32)
        tokenizers = (pipeline.tokenizer, pipeline.tokenizer_2)
        text_encoders = (pipeline.text_encoder.to(dtype), pipeline.text_encoder_2.to(dtype))
        vae = pipeline.vae
    else:
        tokenizers = (
            CLIPTokenizer.from_pretrained(model_name_or_path, subfolder="tokenizer"),
            CLIPTokenizer.from_pretrained(model_name_or_path, subfolder="tokenizer_2"),
        )
        text_encoders = (
            CLIPTextModel.from_pretrained(model_name_or_path, subfolder="text_encoder", dtype=dtype),
            CLIPTextModelWithProjection.from_pretrained(model_name_or_path, subfolder="text_encoder_2", dtype=dtype),
        )
        vae = AutoencoderKL.from_pretrained(model_name_or_path, subfolder="vae")
    if vae_name_or_path:
        vae = AutoencoderKL.from_pretrained(vae_name_or_path)
    vae = vae.to(vae_dtype)
    if vae_dtype == torch.float16 and vae.config.get("force_upcast", False):
        # SDXL's original VAE overflows in fp16; its config asks for fp32 (the fp16-fix VAE does not).
        vae = vae.float()
    for module in (*text_encoders, vae):
        module.requires_grad_(False).eval().to(device)
    return Encoders(tokenizers, text_encoders, vae, device, dtype)
