#!/bin/sh
# Build loraflow's native merge kernel (merge_rows.c -> libloraflow_merge.so beside it).
# Needs a C compiler (CC, default cc); the Makefile's envs target and docker/trainer.Dockerfile run it.
# -ffp-contract=off: the kernel's FMAs are explicit; nothing else may be fused (the same bits on every CPU).
set -eu
here=$(cd "$(dirname "$0")" && pwd)
${CC:-cc} -O3 -fPIC -shared -ffp-contract=off -fno-math-errno -Wall -Wextra -Werror \
    -o "$here/libloraflow_merge.so.partial" "$here/merge_rows.c" -lm
mv "$here/libloraflow_merge.so.partial" "$here/libloraflow_merge.so"
