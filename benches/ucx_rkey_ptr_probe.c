// A check, not part of the runtime: whether UCX here lets one process read memory another
// allocated with ucp_mem_map(UCP_MEM_MAP_ALLOCATE), through ucp_rkey_ptr (a SysV or POSIX
// segment mapped into the reader), and how fast a plain memcpy reads it. The staged
// shared-memory path that BENCHMARKS.md ("UCX collectives", session 33) proposes rests on it.
//
//   gcc -O2 -Wall benches/ucx_rkey_ptr_probe.c -o /tmp/rkp -lucp -lucs && /tmp/rkp 16   # MiB
#include <ucp/api/ucp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/wait.h>
#include <sys/socket.h>
#include <time.h>
#define CHK(x) do { ucs_status_t s_ = (x); if (s_ != UCS_OK) { fprintf(stderr, "%s: %s\n", #x, ucs_status_string(s_)); exit(1);} } while (0)
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
static void sendall(int fd, const void *p, size_t n) { size_t len = n; write(fd, &len, sizeof len); write(fd, p, n); }
static void *recvall(int fd, size_t *n) { read(fd, n, sizeof *n); void *p = malloc(*n); size_t got = 0; while (got < *n) got += read(fd, (char*)p + got, *n - got); return p; }
int main(int argc, char **argv) {
  size_t size = (argc > 1 ? atol(argv[1]) : 16) << 20;
  int sv[2]; socketpair(AF_UNIX, SOCK_STREAM, 0, sv);
  pid_t child = fork();
  int fd = child ? sv[0] : sv[1];
  ucp_config_t *cfg; CHK(ucp_config_read(NULL, NULL, &cfg));
  CHK(ucp_config_modify(cfg, "TLS", "sysv,posix,cma,self"));
  ucp_params_t p; memset(&p, 0, sizeof p);
  p.field_mask = UCP_PARAM_FIELD_FEATURES; p.features = UCP_FEATURE_RMA | UCP_FEATURE_AM;
  ucp_context_h ctx; CHK(ucp_init(&p, cfg, &ctx));
  ucp_worker_params_t wp; memset(&wp, 0, sizeof wp);
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE; wp.thread_mode = UCS_THREAD_MODE_SINGLE;
  ucp_worker_h w; CHK(ucp_worker_create(ctx, &wp, &w));
  ucp_address_t *addr; size_t alen; CHK(ucp_worker_get_address(w, &addr, &alen));
  sendall(fd, addr, alen); size_t plen; void *peer = recvall(fd, &plen);
  ucp_ep_params_t ep; memset(&ep, 0, sizeof ep);
  ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS; ep.address = peer;
  ucp_ep_h e; CHK(ucp_ep_create(w, &ep, &e));
  for (int i = 0; i < 100; i++) ucp_worker_progress(w);
  if (child) {
    // Exposer: allocate, fill, pack rkey, send (addr, rkey), wait for the reader.
    ucp_mem_map_params_t mp; memset(&mp, 0, sizeof mp);
    mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_LENGTH | UCP_MEM_MAP_PARAM_FIELD_FLAGS;
    mp.length = size; mp.flags = UCP_MEM_MAP_ALLOCATE;
    ucp_mem_h memh; CHK(ucp_mem_map(ctx, &mp, &memh));
    ucp_mem_attr_t ma; memset(&ma, 0, sizeof ma); ma.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS | UCP_MEM_ATTR_FIELD_LENGTH;
    CHK(ucp_mem_query(memh, &ma));
    memset(ma.address, 7, size);
    void *rk; size_t rklen; CHK(ucp_rkey_pack(ctx, memh, &rk, &rklen));
    uint64_t a = (uint64_t)ma.address; sendall(fd, &a, sizeof a); sendall(fd, rk, rklen);
    size_t n; free(recvall(fd, &n));
    printf("exposer: mapped %zu bytes at %p, rkey %zu bytes\n", ma.length, ma.address, rklen);
    waitpid(child, NULL, 0);
  } else {
    size_t n; uint64_t *a = recvall(fd, &n); void *rk = recvall(fd, &n);
    ucp_rkey_h rkey; CHK(ucp_ep_rkey_unpack(e, rk, &rkey));
    void *local; ucs_status_t s = ucp_rkey_ptr(rkey, *a, &local);
    printf("reader: ucp_rkey_ptr -> %s\n", ucs_status_string(s));
    if (s == UCS_OK) {
      char *dst = malloc(size); memset(dst, 0, size);
      int ok = 1; for (size_t i = 0; i < size; i += 4096) ok &= ((char*)local)[i] == 7;
      double t0 = now(); int it = 50; for (int k = 0; k < it; k++) memcpy(dst, local, size);
      double t = (now() - t0) / it;
      printf("reader: contents %s, memcpy from the mapping %.2f GB/s\n", ok ? "right" : "WRONG", size / t / 1e9);
    }
    sendall(fd, "x", 1);
  }
  return 0;
}
