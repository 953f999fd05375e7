// Times llama.cpp T5 generation: encode N_IN tokens, then greedy decode exactly N_OUT tokens (EOS ignored).
// usage: t5drive MODEL THREADS IDS N_OUT WARMUP CALLS PAUSE_MS   (IDS: the input token ids, comma-separated)
// prints one JSON line: {"ms": [...], "tokens": [...first call's output ids...]}
#include "llama.h"
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

static void quiet(ggml_log_level, const char *, void *) {}

int main(int argc, char ** argv) {
    if (argc != 8) { fprintf(stderr, "usage: t5drive MODEL THREADS IDS N_OUT WARMUP CALLS PAUSE_MS\n"); return 2; }
    const int threads = atoi(argv[2]), n_out = atoi(argv[4]);
    const int warmup = atoi(argv[5]), calls = atoi(argv[6]), pause_ms = atoi(argv[7]);
    llama_log_set(quiet, nullptr);
    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    llama_model * model = llama_model_load_from_file(argv[1], mp);
    if (!model) { fprintf(stderr, "error: cannot load %s\n", argv[1]); return 1; }
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = 128; cp.n_batch = 128; cp.n_ubatch = 128; cp.n_seq_max = 1;
    cp.n_threads = threads; cp.n_threads_batch = threads; cp.no_perf = true;
    llama_context * ctx = llama_init_from_model(model, cp);
    if (!ctx) { fprintf(stderr, "error: cannot create context\n"); return 1; }
    const llama_vocab * vocab = llama_model_get_vocab(model);
    const int n_vocab = llama_vocab_n_tokens(vocab);
    llama_token start = llama_model_decoder_start_token(model);
    std::vector<llama_token> inp;
    for (char * p = argv[3]; *p; p += (*p == ',')) inp.push_back((llama_token) strtol(p, &p, 10));
    const int n_in = (int) inp.size();
    std::vector<double> ms;
    std::vector<llama_token> first;
    for (int c = 0; c < warmup + calls; c++) {
        std::this_thread::sleep_for(std::chrono::milliseconds(pause_ms));
        std::vector<llama_token> out;
        auto t0 = std::chrono::steady_clock::now();
        llama_memory_clear(llama_get_memory(ctx), true);
        if (llama_encode(ctx, llama_batch_get_one(inp.data(), n_in))) { fprintf(stderr, "error: encode\n"); return 1; }
        llama_token tok = start;
        for (int s = 0; s < n_out; s++) {
            if (llama_decode(ctx, llama_batch_get_one(&tok, 1))) { fprintf(stderr, "error: decode\n"); return 1; }
            const float * logits = llama_get_logits_ith(ctx, -1);
            int best = 0;
            for (int v = 1; v < n_vocab; v++) if (logits[v] > logits[best]) best = v;
            tok = best;
            out.push_back(tok);
        }
        auto t1 = std::chrono::steady_clock::now();
        if (c >= warmup) ms.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
        if (c == 0) first = out;
    }
    printf("{\"ms\": [");
    for (size_t i = 0; i < ms.size(); i++) printf("%s%.3f", i ? ", " : "", ms[i]);
    printf("], \"tokens\": [");
    for (size_t i = 0; i < first.size(); i++) printf("%s%d", i ? ", " : "", first[i]);
    printf("]}\n");
    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
