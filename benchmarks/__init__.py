"""pretrieve's speed and memory benchmarks (benchmarks/README.md): each a module run from the repository root as
`python -m benchmarks.NAME`, its numbers written to benchmarks/results/; `gpu_job` runs them as the job of a short
GPU allocation (`make gpu-check`)."""
