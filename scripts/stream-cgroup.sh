#!/bin/bash
# Streaming under a memory cgroup (issue 16 item 2; docs/PERFORMANCE.md, session 27): a model file
# >= 4x a cgroup v1 memory limit, cold file cache per arm (POSIX_FADV_DONTNEED on the file), 2
# threads; in the same run the disk's O_DIRECT ceiling (`doctor --refresh`), sluice --experts
# stream (S) and llama.cpp through scripts/llama-lbench.cpp with mmap and repacking off, block
# device read-ahead lowered to 128 KB for its arm (L); order S L L S. Root; needs:
#   SLUICE=path/to/sluice LBENCH=path/to/lbench M=model.gguf LIMIT_MIB=900 DEV=vda
# Optional: ARMS (e.g. "S B B S"), N (tokens, 64), SFLAGS (extra flags of S), BASE (a second
# sluice binary, arm B, same flags), PFLAGS and PENV (extra flags and environment assignments of
# arm P, same binary as S; e.g. PENV=SLUICE_READER_NICE=-10). Sluice arms
# run with --prof: their `[experts] disk now` line is the O_DIRECT ceiling measured in the same
# process just after decode, and the run's reads against it (docs/PERFORMANCE.md, session 28).
# lbench: g++ -O2 -std=c++17 -I$LLAMA/include -I$LLAMA/ggml/include scripts/llama-lbench.cpp -o lbench
#   -L$LLAMA/build/bin -lllama -lggml -lggml-base -lggml-cpu -Wl,-rpath,$LLAMA/build/bin
set -u
CG=/sys/fs/cgroup/memory/sluice-stream; RA=/sys/block/${DEV:-vda}/queue/read_ahead_kb
mkdir -p $CG && echo $(( ${LIMIT_MIB:-900} << 20 )) > $CG/memory.limit_in_bytes
incg() { ( echo $BASHPID > $CG/cgroup.procs && exec "$@" ); }
drop() { python3 -c "import os,sys; fd=os.open(sys.argv[1],os.O_RDONLY); os.posix_fadvise(fd,0,0,os.POSIX_FADV_DONTNEED)" "$1"; }
P="The keeper of the lighthouse writes down the level of the sea every hour, and"
uptime
$SLUICE doctor $M --refresh 2>&1 | grep -E 'direct|memory read'
for arm in ${ARMS:-S L L S}; do
  drop $M; echo 0 > $CG/memory.max_usage_in_bytes
  case $arm in
    S|B|P) BIN=$SLUICE; F="${SFLAGS:-}"; E=""; [ $arm = B ] && BIN=$BASE
       [ $arm = P ] && F="${PFLAGS:-}" && E="${PENV:-}"
       incg env $E $BIN run $M -p "$P" -n ${N:-64} --ignore-eos -t 2 --temp 0 -c 512 --experts stream --prof $F 2>&1 >/dev/null |
         grep -E 'budget|expert cache|io:|timing|\[experts\]|\[prof\]|disk|prefetch' | sed "s/^/$arm: /" ;;
    L) OLD=$(cat $RA); echo 128 > $RA
       incg $LBENCH $M 2 0 ${LN:-32} 0 2>&1 | grep -E 'lbench|failed' | sed 's/^/L (ra 128 KB): /'
       echo $OLD > $RA ;;
  esac
  echo "$arm: cgroup peak $(( $(cat $CG/memory.max_usage_in_bytes) >> 20 )) MiB, $(grep '^oom_kill ' $CG/memory.oom_control)"
done
uptime
