// llama-logits: teacher-forced logits of every position from llama.cpp (libllama), the
// reference tests/llama_quant_e2e.rs compares sluice's `sluice logits` with.
// Usage: llama-logits MODEL.gguf 1,5,42,... OUT.f32   (writes float32 [T, n_vocab], row-major)
// CPU only, one batch, all positions output. Built by scripts/build-llama-cpp.sh.
#include "llama.h"
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

int main(int argc, char ** argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: %s MODEL.gguf TOKENS(comma-separated) OUT.f32\n", argv[0]);
        return 2;
    }
    std::vector<llama_token> toks;
    for (const char * p = argv[2]; *p;) {
        char * end = nullptr;
        toks.push_back((llama_token) strtol(p, &end, 10));
        if (end == p) {
            fprintf(stderr, "llama-logits: bad token list\n");
            return 2;
        }
        p = *end == ',' ? end + 1 : end;
    }
    const int n = (int) toks.size();
    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    llama_model * model = llama_model_load_from_file(argv[1], mp);
    if (!model) {
        fprintf(stderr, "llama-logits: cannot load %s\n", argv[1]);
        return 1;
    }
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = n;
    cp.n_batch = n;
    cp.n_ubatch = n;
    cp.no_perf = true;
    llama_context * ctx = llama_init_from_model(model, cp);
    if (!ctx) {
        fprintf(stderr, "llama-logits: cannot create a context\n");
        return 1;
    }
    llama_batch_ext * batch = llama_batch_ext_init(ctx);
    for (int i = 0; i < n; ++i) {
        const int32_t idx = llama_batch_ext_add_token(batch, 0, toks[i]);
        const llama_pos pos = i;
        llama_batch_ext_set_pos(batch, idx, &pos);
        llama_batch_ext_set_output_logits(batch, idx, true);
    }
    if (llama_process(ctx, LLAMA_PROCESS_TYPE_DECODE, batch)) {
        fprintf(stderr, "llama-logits: decode failed\n");
        return 1;
    }
    FILE * f = fopen(argv[3], "wb");
    if (!f) {
        fprintf(stderr, "llama-logits: cannot write %s\n", argv[3]);
        return 1;
    }
    for (int i = 0; i < n; ++i) {
        const float * l = llama_get_logits_ith(ctx, i);
        if (!l || fwrite(l, sizeof(float), n_vocab, f) != (size_t) n_vocab) {
            fprintf(stderr, "llama-logits: no logits for position %d\n", i);
            return 1;
        }
    }
    fclose(f);
    llama_batch_ext_free(batch);
    llama_free(ctx);
    llama_model_free(model);
    return 0;
}
