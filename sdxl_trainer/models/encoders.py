"""SDXL's frozen encoders: both text encoders and the VAE, loaded once and used for caching, and the rule
that turns captions into SDXL's text conditioning (also for the trainer's sample prompts).

Long captions: CLIP has 77 positions, <start> + 75 tokens + <end>. A caption is cut into chunks of 75
tokens, each encoded on its own with its own <start>/<end> (and padding), and the chunks' hidden states are
concatenated: `chunks` x 77 tokens of conditioning, every caption padded to the same count. The pooled
embedding is the first chunk's. This is how A1111 and ComfyUI encode prompts over 75 tokens, so a model
trained on 150 or 225 tokens is prompted the same way there; with one chunk it is exactly SDXL's usual
encoding (truncated at 75 tokens)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from sdxl_trainer.models.single_file import SDXL_CONFIG_SOURCE, config_source, is_single_file, load_pipeline, load_tokenizers

if TYPE_CHECKING:  # imported where models load: a start refused for a bad flag or cache need not import them
    from diffusers import AutoencoderKL
    from transformers import CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

    TextSide = tuple[tuple[CLIPTokenizer, CLIPTokenizer], tuple[CLIPTextModel, CLIPTextModelWithProjection]]

TEXT_MAX_LENGTH = 77  # CLIP's positions
TOKENS_PER_CHUNK = TEXT_MAX_LENGTH - 2  # less <start> and <end>


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


def chunks_for(max_token_length: int) -> int:
    """--max_token_length (75, 150 or 225) -> chunks of 75 tokens."""
    if max_token_length <= 0 or max_token_length % TOKENS_PER_CHUNK:
        raise ValueError(f"--max_token_length must be a multiple of {TOKENS_PER_CHUNK} (75, 150 or 225), got {max_token_length}")
    return max_token_length // TOKENS_PER_CHUNK


@dataclass
class CaptionEmbeddings:
    prompt_embeds: torch.Tensor  # (N, chunks x 77, 2048): penultimate hidden states of both encoders side by side
    pooled_prompt_embeds: torch.Tensor  # (N, 1280): encoder 2's pooled projection of the first chunk
    token_counts: list[int]  # tokens of each caption before any cut (more than chunks x 75: truncated)


def chunked_token_ids(tokenizer: CLIPTokenizer, captions: list[str], chunks: int) -> tuple[torch.Tensor, list[int]]:
    """(N x chunks, 77) token ids: each caption's tokens in chunks of 75, each chunk as the tokenizer would
    encode it alone (<start>, tokens, <end>, padding), empty chunks for short captions; and each caption's
    token count before the cut."""
    content = tokenizer(captions, add_special_tokens=False, truncation=False, verbose=False).input_ids
    rows = []
    for ids in content:
        for chunk in range(chunks):
            part = ids[chunk * TOKENS_PER_CHUNK : (chunk + 1) * TOKENS_PER_CHUNK]
            rows.append([tokenizer.bos_token_id, *part, tokenizer.eos_token_id] + [tokenizer.pad_token_id] * (TOKENS_PER_CHUNK - len(part)))
    return torch.tensor(rows, dtype=torch.long), [len(ids) for ids in content]


def encode_prompts(
    tokenizers: tuple[CLIPTokenizer, CLIPTokenizer],
    text_encoders: tuple[CLIPTextModel, CLIPTextModelWithProjection],
    captions: list[str],
    chunks: int,
    device: torch.device,
) -> CaptionEmbeddings:
    """Captions -> SDXL's text conditioning by the chunk rule of this module's docstring, in fp32 on `device`.
    Gradients flow to the encoders where they are enabled (--train_text_encoder); wrap inference in torch.no_grad()."""
    token_ids, token_counts = zip(*(chunked_token_ids(tokenizer, captions, chunks) for tokenizer in tokenizers))
    prompt_embeds, pooled = encode_token_ids(text_encoders, [ids.to(device) for ids in token_ids], chunks)
    return CaptionEmbeddings(prompt_embeds, pooled, list(token_counts[-1]))


def encode_token_ids(
    text_encoders: tuple[CLIPTextModel, CLIPTextModelWithProjection], token_ids: list[torch.Tensor], chunks: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each encoder's (N x chunks, 77) token ids (chunked_token_ids) -> prompt embeddings (N, chunks x 77, 2048)
    and pooled embeddings (N, 1280), in fp32 on the ids' device."""
    hidden_states = []
    pooled = None
    for ids, encoder in zip(token_ids, text_encoders):
        count = len(ids) // chunks
        output = encoder(ids, output_hidden_states=True)
        hidden_states.append(output.hidden_states[-2].reshape(count, chunks * TEXT_MAX_LENGTH, -1))
        pooled = output[0].reshape(count, chunks, -1)[:, 0]  # text_embeds of CLIPTextModelWithProjection (the last encoder)
    return torch.cat(hidden_states, dim=-1).float(), pooled.float()


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
    def encode_captions(self, captions: list[str], chunks: int) -> CaptionEmbeddings:
        """Captions -> prompt embeddings (N, chunks x 77, 2048), pooled embeddings (N, 1280) (on the CPU) and token counts."""
        encoded = encode_prompts(self.tokenizers, self.text_encoders, captions, chunks, self.device)
        return CaptionEmbeddings(encoded.prompt_embeds.cpu(), encoded.pooled_prompt_embeds.cpu(), encoded.token_counts)

    @torch.no_grad()
    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor:
        """(N, 3, H, W) in [-1, 1] -> scaled latents (N, 4, H/8, W/8). The distribution's mean is used,
        so the cache is deterministic (SDXL's VAE posterior std is tiny next to the mean)."""
        posterior = self.vae.encode(pixels.to(self.device, self.vae.dtype)).latent_dist
        return (posterior.mean.float() * self.latent_scaling_factor).cpu()


def _text_side(model_name_or_path: str, single_file_config: str, text_dtype: torch.dtype) -> tuple[TextSide, AutoencoderKL]:
    """Both tokenizers and text encoders (loaded in text_dtype), and the model's VAE (fp32); on the CPU."""
    from diffusers import AutoencoderKL
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    if is_single_file(model_name_or_path):
        pipeline = load_pipeline(model_name_or_path, single_file_config, torch.float32)
        return ((pipeline.tokenizer, pipeline.tokenizer_2), (pipeline.text_encoder, pipeline.text_encoder_2)), pipeline.vae
    tokenizers = load_tokenizers(model_name_or_path)
    text_encoders = (
        CLIPTextModel.from_pretrained(model_name_or_path, subfolder="text_encoder", dtype=text_dtype),
        CLIPTextModelWithProjection.from_pretrained(model_name_or_path, subfolder="text_encoder_2", dtype=text_dtype),
    )
    return (tokenizers, text_encoders), AutoencoderKL.from_pretrained(model_name_or_path, subfolder="vae")


def _frozen(module: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    # diffusers warns about any .to(dtype) of a model, even to the dtype it has: cast only where it changes.
    moved = module.to(device) if module.dtype == dtype else module.to(device, dtype)
    return moved.requires_grad_(False).eval()


def load_text_encoders(
    model_name_or_path: str, device: torch.device, dtype: torch.dtype, single_file_config: str = SDXL_CONFIG_SOURCE,
    trained: tuple[bool, bool] = (False, False), checkpointed: bool = False, trained_dtype: torch.dtype = torch.float32,
) -> TextSide:
    """Both tokenizers and both text encoders on `device` (the trainer's caption mode): frozen ones in `dtype`,
    those `trained` says (CLIP-L, bigG) in trained_dtype (their master weights) in train mode with gradients, each CLIP
    layer's activations recomputed in backward with checkpointed=True (--gradient_checkpointing).

    Trained, CLIP-L's last layer and final norm stay frozen: SDXL reads CLIP-L's penultimate hidden
    state and takes the pooled embedding from bigG alone, so they never reach the UNet and get no gradient."""
    (tokenizers, text_encoders), _ = _text_side(model_name_or_path, single_file_config, trained_dtype if any(trained) else dtype)
    prepared = []
    for encoder, trains in zip(text_encoders, trained):
        if not trains:
            prepared.append(_frozen(encoder, device, dtype))
            continue
        prepared.append(trainable_text_encoder(encoder.to(device, trained_dtype), checkpointed))
    return tokenizers, tuple(prepared)  # type: ignore[return-value]


def trainable_text_encoder(encoder: CLIPTextModel | CLIPTextModelWithProjection, checkpointed: bool) -> torch.nn.Module:
    """The encoder in train mode with gradients (load_text_encoders' trained ones; the memory estimate's), in
    place, each CLIP layer's activations recomputed in backward with checkpointed=True. CLIP-L's last layer
    and final norm stay frozen (see load_text_encoders)."""
    from transformers import CLIPTextModel

    encoder.requires_grad_(True).train()
    if checkpointed:
        encoder.activation_checkpointing_enable()  # non-reentrant torch.utils.checkpoint per layer
    if isinstance(encoder, CLIPTextModel):
        encoder.encoder.layers[-1].requires_grad_(False)
        encoder.final_layer_norm.requires_grad_(False)
    return encoder


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
    (tokenizers, text_encoders), vae = _text_side(model_name_or_path, single_file_config, dtype)
    if vae_name_or_path:
        from diffusers import AutoencoderKL

        vae = AutoencoderKL.from_pretrained(vae_name_or_path)
    if vae_dtype == torch.float16 and vae.config.get("force_upcast", False):
        # SDXL's original VAE overflows in fp16; its config asks for fp32 (the fp16-fix VAE does not).
        vae_dtype = torch.float32
    text_encoders = tuple(_frozen(encoder, device, dtype) for encoder in text_encoders)
    return Encoders(tokenizers, text_encoders, _frozen(vae, device, vae_dtype), device, dtype)  # type: ignore[arg-type]
