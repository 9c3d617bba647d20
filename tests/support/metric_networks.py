"""Weight files of small or random-initialised networks with the real metric architectures, for offline tests:
InceptionV3 (torch-fidelity's layout), AlexNet (torchvision's), and a tiny open_clip CLIP of the ViT family
standing in for HPSv2's ViT-H-14. They go through the same loading code as the real files."""

from __future__ import annotations

import json
import os
from pathlib import Path

import open_clip
import torch
import torchvision
from torch import nn

from sdxl_trainer.evaluation.metrics import MetricWeights

TINY_CLIP = "HPS-test-tiny-ViT"
TINY_CLIP_CONFIG = {
    "embed_dim": 16,
    "vision_cfg": {"image_size": 224, "layers": 1, "width": 32, "head_width": 16, "patch_size": 32},
    "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1},
}


def random_inception_state_dict(seed: int = 0) -> dict[str, torch.Tensor]:
    """torchvision's InceptionV3 has torch-fidelity's parameter names; its fc is resized to the 1008 classes of
    the TensorFlow network. Convolutions get Kaiming initialisation: with the default small-normal init the
    activations vanish through the 90 layers and every image gets the same features."""
    torch.manual_seed(seed)
    network = torchvision.models.inception_v3(weights=None, aux_logits=False, init_weights=False)
    for module in network.modules():
        if isinstance(module, nn.Conv2d):
            nn.init.kaiming_normal_(module.weight, nonlinearity="relu")
    # Random features of different images differ by little; large output weights make the class
    # probabilities differ between images, as a trained network's do (else the Inception Score is 1).
    network.fc = nn.Linear(2048, 1008)
    nn.init.normal_(network.fc.weight, std=1.0)
    return network.state_dict()


def register_tiny_clip(folder: Path) -> str:
    """Make the tiny CLIP config known to open_clip (as ViT-H-14's config is) and return its name. The ranks
    of a run call it at once, each rewriting the file and open_clip reading it back: the file is replaced
    whole, as a rank that read it while another truncated it failed on an empty JSON file."""
    folder.mkdir(parents=True, exist_ok=True)
    config = folder / f"{TINY_CLIP}.json"
    partial = config.with_name(f"{config.name}.{os.getpid()}.partial")
    partial.write_text(json.dumps(TINY_CLIP_CONFIG))
    os.replace(partial, config)
    open_clip.add_model_config(config)
    return TINY_CLIP


def write_metric_weights(folder: Path, seed: int = 0) -> MetricWeights:
    """Weight files for every metric network (random, real architectures); HPS in its checkpoint format."""
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(random_inception_state_dict(seed), folder / "inception.pth")
    torch.manual_seed(seed)
    torch.save(torchvision.models.alexnet().state_dict(), folder / "alexnet.pth")
    register_tiny_clip(folder)
    torch.manual_seed(seed)
    clip = open_clip.create_model(TINY_CLIP, pretrained=None)
    torch.save({"epoch": 1, "state_dict": clip.state_dict()}, folder / "hps.pt")
    return MetricWeights(inception=folder / "inception.pth", lpips=folder / "alexnet.pth", hpsv2=folder / "hps.pt")
