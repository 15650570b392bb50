#!/usr/bin/env bash
# Assembles a CUDA 12.4 toolkit that compiles this module, from Debian's packages, without root
# and without touching the machine's apt setup; prints its path (CUDA12_HOME) as the last line.
#
#   CUDA12_HOME=$(bash scripts/cuda12_toolkit.sh)      # .cuda12/cuda-12.4, reused once assembled
#
# Why Debian: PyPI's CUDA 12 compiler wheels (nvidia-cuda-nvcc-cu12, 12.0 to 12.9) hold only
# ptxas, libnvvm, libdevice and the crt/ headers: no nvcc driver, cicc, cudafe++, fatbinary or
# nvlink (docs/notes.md lists the files). Debian 13 ("trixie", non-free) packages NVIDIA's CUDA
# 12.4.1 binaries, one coherent release:
#   nvidia-cuda-toolkit  nvcc, cicc, cudafe++, fatbinary, nvlink, ptxas, bin2c, libdevice
#   nvidia-cuda-dev      headers, libcudart_static.a, libcudadevrt.a (934 MB: only those are kept)
#   libcudart12          libcudart.so (CMake's FindCUDAToolkit insists on it; the module links
#                        the static runtime)
#   libcu++-dev (main)   CCCL 2.3.2's libcu++ (cuda/std/...), which nvshmem.h includes
# apt-get downloads them into a private apt state under .cuda12/apt (sources: the Debian mirror
# this machine's apt already uses, suite trixie; DEBIAN_MIRROR overrides it), then they are
# unpacked with dpkg-deb into NVIDIA's usual layout (bin/, nvvm/, include/, lib64/) with NVIDIA's
# nvcc.profile. Nothing is installed. The debs are deleted after unpacking (KEEP_DEBS=1 keeps
# them). The packages are NVIDIA's, under the CUDA EULA, as with the pip wheels.
#
# nvcc 12.4 accepts GCC up to 13 (Debian 12 has 12.2); with a newer g++ set CUDAHOSTCXX=g++-13.
# CUDA 12.4 has no sm_100: build with JMC_CUDA_ARCHS="80;90" (scripts/build_cuda12.sh does).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
say() { echo "cuda12_toolkit: $*" >&2; }
DEST=${CUDA12_TOOLKIT_DIR:-$ROOT/.cuda12}
SUITE=${CUDA12_DEBIAN_SUITE:-trixie}
# Exact versions (trixie's CUDA 12.4.1); all four from one CUDA release.
PACKAGES=(nvidia-cuda-toolkit=12.4.131~12.4.1-2 nvidia-cuda-dev=12.4.127~12.4.1-2
          libcudart12=12.4.127~12.4.1-2 libcu++-dev=2.3.2-2)
HOME12="$DEST/cuda-12.4"
STAMP="$HOME12/assembled-from"

if [ -x "$HOME12/bin/nvcc" ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$SUITE ${PACKAGES[*]}" ]; then
  say "reusing $HOME12 (assembled from ${PACKAGES[*]}; delete it to assemble again)"
  echo "$HOME12"
  exit 0
fi
for tool in apt-get dpkg-deb tar; do
  if ! command -v "$tool" >/dev/null; then
    say "needs $tool (a Debian or Ubuntu machine); elsewhere set CUDA12_HOME to a CUDA 12" \
        "toolkit instead (a full one: nvcc, cicc, fatbinary, nvlink, libcudart_static.a)"
    exit 2
  fi
done
MIRROR=${DEBIAN_MIRROR:-$(apt-get indextargets --format '$(REPO_URI)|$(LABEL)' 2>/dev/null \
                          | awk -F'|' '$2 == "Debian" {print $1; exit}')}
KEYRING=${DEBIAN_KEYRING:-/usr/share/keyrings/debian-archive-keyring.gpg}
if [ -z "$MIRROR" ]; then
  say "this machine's apt has no Debian mirror configured to borrow: set DEBIAN_MIRROR to one" \
      "(the URL of a Debian archive, as in /etc/apt/sources.list), or CUDA12_HOME to a toolkit"
  exit 2
fi

APT="$DEST/apt"
rm -rf "$APT" "$HOME12"
mkdir -p "$APT/lists/partial" "$APT/cache/archives/partial" "$APT/debs" "$APT/x"
echo "deb [signed-by=$KEYRING] $MIRROR $SUITE main non-free" > "$APT/sources.list"
apt_opts=(-o "Dir::Etc::SourceList=$APT/sources.list" -o Dir::Etc::SourceParts=/dev/null
          -o "Dir::State::Lists=$APT/lists" -o "Dir::Cache=$APT/cache"
          -o Dir::State::status=/dev/null -o APT::Sandbox::User=root)
t0=$(date +%s)
say "reading $SUITE's package lists (main, non-free) into $APT"
apt-get "${apt_opts[@]}" -qq update >&2
say "downloading ${PACKAGES[*]} (about 1 GB)"
(cd "$APT/debs" && apt-get "${apt_opts[@]}" -qq download "${PACKAGES[@]}" >&2)
say "unpacking"
X="$APT/x"
for deb in "$APT"/debs/*.deb; do
  case "$(basename "$deb")" in
    nvidia-cuda-dev_*)  # headers and the two static runtime archives only
      dpkg-deb --fsys-tarfile "$deb" | tar -x -C "$X" ./usr/include \
        ./usr/lib/x86_64-linux-gnu/libcudart_static.a ./usr/lib/x86_64-linux-gnu/libcudadevrt.a \
        ./usr/lib/x86_64-linux-gnu/libculibos.a ./usr/lib/x86_64-linux-gnu/stubs/libcuda.so ;;
    *) dpkg-deb -x "$deb" "$X" ;;
  esac
done

# NVIDIA's layout, which nvcc.profile and CMake's FindCUDAToolkit expect.
L="$X/usr/lib/nvidia-cuda-toolkit"
mkdir -p "$HOME12/bin/crt" "$HOME12/nvvm/bin" "$HOME12/nvvm/libdevice" "$HOME12/include" \
         "$HOME12/lib/stubs" "$HOME12/targets/x86_64-linux"
cp -a "$L/bin/nvcc" "$HOME12/bin/"          # /usr/bin/nvcc is Debian's wrapper script
cp -a "$L/bin/crt/link.stub" "$L/bin/crt/prelink.stub" "$HOME12/bin/crt/"
for b in bin2c cudafe++ fatbinary nvlink ptxas cuobjdump nvdisasm nvprune cu++filt; do
  cp -a "$X/usr/bin/$b" "$HOME12/bin/"
done
cp -a "$L/bin/cicc" "$HOME12/nvvm/bin/"
cp -a "$L/libdevice/libdevice.10.bc" "$HOME12/nvvm/libdevice/"
cp -a "$X/usr/include/." "$HOME12/include/"   # CUDA's headers and libcu++ (cuda/std)
cp -a "$X"/usr/lib/x86_64-linux-gnu/*.a "$X"/usr/lib/x86_64-linux-gnu/libcudart.so.12* \
      "$HOME12/lib/"
ln -s libcudart.so.12 "$HOME12/lib/libcudart.so"
cp -a "$X/usr/lib/x86_64-linux-gnu/stubs/libcuda.so" "$HOME12/lib/stubs/"
ln -s lib "$HOME12/lib64"
ln -s ../../include "$HOME12/targets/x86_64-linux/include"
ln -s ../../lib "$HOME12/targets/x86_64-linux/lib"
cat > "$HOME12/bin/nvcc.profile" <<'EOF'

TOP              = $(_HERE_)/..

NVVMIR_LIBRARY_DIR = $(TOP)/nvvm/libdevice

LD_LIBRARY_PATH += $(TOP)/lib:
PATH            += $(TOP)/nvvm/bin:$(_HERE_):

INCLUDES        +=  "-I$(TOP)/$(_TARGET_DIR_)/include" $(_SPACE_)

LIBRARIES        =+ $(_SPACE_) "-L$(TOP)/$(_TARGET_DIR_)/lib$(_TARGET_SIZE_)/stubs" "-L$(TOP)/$(_TARGET_DIR_)/lib$(_TARGET_SIZE_)"

CUDAFE_FLAGS    +=
PTXAS_FLAGS     +=
EOF
rm -rf "$X"
[ -n "${KEEP_DEBS:-}" ] || rm -rf "$APT/debs"
"$HOME12/bin/nvcc" --version | grep -q 'release 12\.4' || { say "nvcc 12.4 does not run"; exit 1; }
echo "$SUITE ${PACKAGES[*]}" > "$STAMP"
say "assembled $HOME12 ($(du -sh "$HOME12" | cut -f1)) in $(( $(date +%s) - t0 )) s"
echo "$HOME12"
