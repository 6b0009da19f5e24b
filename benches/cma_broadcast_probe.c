// How fast one process can read another's memory with process_vm_readv (what a pulled
// broadcast does, `src/runtime/step/broadcast_pull.rs`), with and without transparent huge
// pages, and with the copy split between the reader and the owner (process_vm_writev).
//   gcc -O2 benches/cma_broadcast_probe.c -o /tmp/cma && /tmp/cma MIB ITERS BLOCK_KIB THP SPLIT
//   e.g. /tmp/cma 64 30 1024 1 1.0   (64 MiB, 30 timed iterations, 1 MiB reads, huge pages,
//   all read by the receiver; SPLIT 0.5: the owner writes the second half into the reader)
#define _GNU_SOURCE
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

typedef struct {
  _Atomic long done[2];
  _Atomic long start[2];
  pid_t pid[2];
  char *buf[2];
} Shared;

static void wait_for(_Atomic long *f, long v) {
  while (atomic_load(f) < v) sched_yield();
}

int main(int argc, char **argv) {
  if (argc != 6) {
    fprintf(stderr, "usage: %s MIB ITERS BLOCK_KIB THP(0|1) SPLIT(0..1)\n", argv[0]);
    return 2;
  }
  size_t size = (size_t)atoi(argv[1]) << 20, blk = (size_t)atoi(argv[3]) << 10;
  int iters = atoi(argv[2]), thp = atoi(argv[4]);
  double split = atof(argv[5]);
  Shared *sh = mmap(0, sizeof(Shared), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  memset(sh, 0, sizeof(*sh));
  for (int r = 0; r < 2; r++) {
    if (fork() != 0) continue;
    char *buf = aligned_alloc(2 << 20, size);
    if (thp) madvise(buf, size, MADV_HUGEPAGE);
    memset(buf, r + 1, size);
    sh->pid[r] = getpid();
    sh->buf[r] = buf;
    atomic_store(&sh->start[r], 1);
    for (int k = 0; k < 2; k++) wait_for(&sh->start[k], 1);
    size_t cut = (size_t)(size * split) & ~(size_t)4095;
    double t0 = 0;
    for (int it = 1; it <= iters + 1; it++) {
      if (it == 2) t0 = now();  // the first iteration faults the pages in
      size_t from = r == 1 ? 0 : cut, to = r == 1 ? cut : size;
      for (size_t off = from; off < to; off += blk) {
        size_t len = to - off < blk ? to - off : blk;
        struct iovec mine = {buf + off, len}, theirs = {sh->buf[1 - r] + off, len};
        ssize_t n = r == 1 ? process_vm_readv(sh->pid[0], &mine, 1, &theirs, 1, 0)
                           : process_vm_writev(sh->pid[1], &mine, 1, &theirs, 1, 0);
        if (n != (ssize_t)len) {
          perror("process_vm_readv/writev");
          exit(1);
        }
      }
      atomic_store(&sh->done[r], it);
      for (int k = 0; k < 2; k++) wait_for(&sh->done[k], it);
    }
    double t = now() - t0;
    if (r == 1)
      printf("%zu MiB, %zu KiB reads, huge pages %d, read share %.2f: %.3f ms, %.2f GB/s\n",
             size >> 20, blk >> 10, thp, split, t / iters * 1e3, size / (t / iters) / 1e9);
    exit(0);
  }
  for (int r = 0; r < 2; r++) wait(0);
  return 0;
}
