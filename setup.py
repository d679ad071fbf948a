from setuptools import find_packages, setup

setup(
    name="ulysses-sp",
    version="0.1.0",
    description="Ulysses / head-chunked / ring sequence parallelism for multi-million-token LLM training",
    long_description=open("README.md").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["ulysses", "ulysses.*", "arctic", "arctic.*", "offload", "offload.*"]),
    # A range, never a pin: GPU users keep the CUDA build they already have. The lower bounds
    # of the HF-facing packages are the oldest versions CI runs (.ci/lower_bounds.py reads
    # them): transformers 5.13 is the first whose Nemotron attention goes through
    # AttentionInterface; accelerate 1.3 the first whose unwrap_model takes the
    # keep_torch_compile that transformers' Trainer passes; deepspeed 0.19.8 the oldest the
    # whole suite ran on (0.17.0 passes the HF-facing tests, but its ZeRO-2 step and offloaded
    # state differ from what the tests and the planner expect, and it lacks the
    # TiledFusedLogitsLoss the benchmarks' ALST peer uses).
    # torch 2.13 is the oldest release the suite runs on (CI: 2.13.0 and the newest).
    install_requires=["torch>=2.13", "einops>=0.7"],
    extras_require={
        "test": ["pytest>=7", "deepspeed>=0.19.8", "numpy", "transformers>=5.13.0", "accelerate>=1.3.0",
                 "matplotlib", "trl"],
        "hf": ["deepspeed>=0.19.8", "transformers>=5.13.0", "accelerate>=1.3.0"],
        "plan": ["transformers>=5.13.0", "matplotlib"],  # python -m arctic.plan [--plot]
    },
)
