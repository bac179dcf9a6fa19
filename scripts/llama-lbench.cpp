// Minimal llama.cpp timing: pp (one batch of P token ids) and tg (N single-token decodes)
// usage: lbench MODEL THREADS P N REPACK(0|1)
#include "llama.h"
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>
static double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
int main(int argc, char ** argv) {
    if (argc < 6) { fprintf(stderr, "usage: %s MODEL THREADS P N REPACK\n", argv[0]); return 1; }
    int th = atoi(argv[2]), P = atoi(argv[3]), N = atoi(argv[4]), rp = atoi(argv[5]);
    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    mp.use_extra_bufts = rp != 0;
    mp.load_mode = LLAMA_LOAD_MODE_MMAP;
    double t0 = now();
    llama_model * model = llama_model_load_from_file(argv[1], mp);
    if (!model) { fprintf(stderr, "load failed\n"); return 1; }
    double t_load = now() - t0;
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = P + N + 16; cp.n_batch = P > 0 ? P : 1; cp.n_ubatch = cp.n_batch;
    cp.n_threads = th; cp.n_threads_batch = th;
    llama_context * ctx = llama_init_from_model(model, cp);
    if (!ctx) { fprintf(stderr, "context failed\n"); return 1; }
    std::vector<llama_token> toks(P > 0 ? P : 1);
    for (size_t i = 0; i < toks.size(); i++) toks[i] = 1000 + (int)(i * 37 % 5000);
    double pp = 0;
    if (P > 0) {
        double t = now();
        if (llama_decode(ctx, llama_batch_get_one(toks.data(), P))) { fprintf(stderr, "decode failed\n"); return 1; }
        pp = P / (now() - t);
    } else {
        if (llama_decode(ctx, llama_batch_get_one(toks.data(), 1))) { fprintf(stderr, "decode failed\n"); return 1; }
    }
    llama_token tk = 1234;
    double t = now();
    for (int i = 0; i < N; i++) {
        if (llama_decode(ctx, llama_batch_get_one(&tk, 1))) { fprintf(stderr, "decode failed\n"); return 1; }
        tk = 1000 + (i * 53 % 5000);
    }
    double tg = N / (now() - t);
    printf("lbench threads %d repack %d: load %.1f s | pp%d %.2f tok/s | tg%d %.2f tok/s\n", th, rp, t_load, P, pp, N, tg);
    llama_free(ctx); llama_model_free(model);
    return 0;
}
