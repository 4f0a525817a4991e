#!/usr/bin/env bash
# Builds Gpufit (github.com/gpufit/Gpufit, MIT) for the GPU of the machine it runs on, and a
# driver: ../shared/cpufit/cpufit_bench.cpp with Cpufit's call swapped for Gpufit's (same
# signature, same data generator, same output files), for benchmarks/gpufit_side_by_side.py.
#   build_gpufit.sh GPUFIT_SRC OUT [DRIVER_CPP]
# Needs nvcc. ARCH (default sm_90, the H100/H200) sets the target. Gpufit's CMake file uses
# CMake's removed FindCUDA module, so this calls nvcc directly; cuBLAS off, as Gpufit's default.
set -euo pipefail
SRC=$(realpath "${1:?usage: build_gpufit.sh GPUFIT_SRC OUT [DRIVER_CPP]}")
OUT=$(realpath -m "${2:?usage: build_gpufit.sh GPUFIT_SRC OUT [DRIVER_CPP]}")
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
DRIVER=${3:-$HERE/../../shared/cpufit/cpufit_bench.cpp}
ARCH=${ARCH:-sm_90}
NVCC=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
mkdir -p "$OUT/obj"
cd "$SRC/Gpufit"
pids=()
for f in *.cu *.cpp; do
  "$NVCC" -O3 -std=c++14 -arch="$ARCH" -Xcompiler -fPIC -I. -c "$f" -o "$OUT/obj/$f.o" & pids+=($!)
done
for p in "${pids[@]}"; do wait "$p"; done
"$NVCC" -shared -arch="$ARCH" -o "$OUT/libGpufit.so" "$OUT"/obj/*.o
sed -e 's#Cpufit/cpufit.h#Gpufit/gpufit.h#' -e 's/cpufit_get_last_error/gpufit_get_last_error/' \
    -e 's/int const status = cpufit(/int const status = gpufit(/' \
    -e 's/"cpufit size=/"gpufit size=/' -e 's/Error in cpufit/Error in gpufit/' "$DRIVER" > "$OUT/gpufit_bench.cpp"
g++ -O3 -DNDEBUG -std=c++14 -I "$SRC" "$OUT/gpufit_bench.cpp" -o "$OUT/gpufit_bench" \
    -L "$OUT" -lGpufit -Wl,-rpath,"$OUT"
echo "built $OUT/gpufit_bench"
