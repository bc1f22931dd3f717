// MTP reference dumper over libllama (llama.cpp's qwen35 `graph_mtp`, driven as common/speculative.cpp's
// draft-mtp does). usage: mtpdump model.gguf ids.bin K NDRAFT
// 1. the target decodes the prompt with its normed hidden states (h_nextn) out for every position;
// 2. the MTP context decodes every prompt token i paired with the target's h of i-1 (zeros at 0):
//    a JSON line with the top-K MTP logits per position;
// 3. from the target's greedy next token t at position n with h of n-1, a greedy chain of NDRAFT
//    draft steps, each fed the MTP's own h_nextn: a JSON line per step (top-K logits).
// float32 KV and no flash attention, as refdump_f32kv.c.
#include "llama.h"
#include "llama-ext.h"
#include <cstdio>
#include <cstdlib>
#include <vector>

static void top(const float *lg, int nv, int K, const char *key, int i) {
    std::vector<int> ids(K, -1);
    for (int j = 0; j < nv; j++) {
        int p = K;
        while (p > 0 && (ids[p-1] < 0 || lg[j] > lg[ids[p-1]])) p--;
        if (p < K) { for (int q = K-1; q > p; q--) ids[q] = ids[q-1]; ids[p] = j; }
    }
    printf("{\"%s\":%d,\"top\":[", key, i);
    for (int k = 0; k < K; k++) printf("%s[%d,%.5f]", k ? "," : "", ids[k], lg[ids[k]]);
    printf("]}\n");
}

static void add(llama_batch_ext *b, llama_token tok, int pos, const float *h, int n_embd) {
    int idx = llama_batch_ext_add_token(b, 0, tok);
    llama_pos p[4] = {pos, 0, 0, 0};
    llama_batch_ext_set_pos(b, idx, p);
    llama_batch_ext_set_embd_token(b, idx, {h, 1, (size_t) n_embd});
    llama_batch_ext_set_output_logits(b, idx, true);
}

int main(int argc, char **argv) {
    if (argc != 5) { fprintf(stderr, "usage: mtpdump model.gguf ids.bin K NDRAFT\n"); return 2; }
    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    mp.load_mtp = true;
    llama_model *m = llama_model_load_from_file(argv[1], mp);
    int nv = llama_vocab_n_tokens(llama_model_get_vocab(m)), n_embd = llama_model_n_embd_out(m);
    FILE *f = fopen(argv[2], "rb"); fseek(f, 0, SEEK_END); long n = ftell(f) / 4; fseek(f, 0, SEEK_SET);
    std::vector<llama_token> ids(n); if (fread(ids.data(), 4, n, f) != (size_t) n) return 1; fclose(f);
    int K = atoi(argv[3]), ND = atoi(argv[4]);
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = 4096; cp.n_batch = 4096; cp.n_ubatch = 512; cp.n_threads = 2; cp.n_threads_batch = 2;
    cp.type_k = GGML_TYPE_F32; cp.type_v = GGML_TYPE_F32; cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
    llama_context *tgt = llama_init_from_model(m, cp);
    llama_set_embeddings_nextn(tgt, true, false);
    llama_context_params cd = cp;
    cd.ctx_type = LLAMA_CONTEXT_TYPE_MTP; cd.ctx_other = tgt; cd.n_rs_seq = 0;
    llama_context *dft = llama_init_from_model(m, cd);
    llama_set_embeddings_nextn(dft, true, true);

    llama_batch b = llama_batch_init((int) n, 0, 1);
    for (int i = 0; i < n; i++) { b.token[i] = ids[i]; b.pos[i] = i; b.n_seq_id[i] = 1; b.seq_id[i][0] = 0; b.logits[i] = 1; }
    b.n_tokens = (int) n;
    if (llama_decode(tgt, b)) { fprintf(stderr, "target decode failed\n"); return 1; }
    std::vector<float> H((size_t) n * n_embd), zeros(n_embd, 0.0f);
    for (int i = 0; i < n; i++) {
        const float *h = llama_get_embeddings_nextn_ith(tgt, i);
        for (int j = 0; j < n_embd; j++) H[(size_t) i * n_embd + j] = h[j];
    }
    const float *last = llama_get_logits_ith(tgt, (int) n - 1);
    llama_token t = 0;
    for (int j = 1; j < nv; j++) if (last[j] > last[t]) t = j;

    llama_batch_ext *be = llama_batch_ext_init(dft);
    for (int i = 0; i < n; i++) add(be, ids[i], i, i ? &H[(size_t) (i - 1) * n_embd] : zeros.data(), n_embd);
    if (llama_process(dft, LLAMA_PROCESS_TYPE_DECODE, be)) { fprintf(stderr, "MTP decode failed\n"); return 1; }
    for (int i = 0; i < n; i++) top(llama_get_logits_ith(dft, i), nv, K, "pos", i);

    printf("{\"target_next\":%d}\n", t);
    std::vector<float> h(H.end() - n_embd, H.end());
    for (int s = 0; s < ND; s++) {
        llama_batch_ext_clear(be);
        add(be, t, (int) n + s, h.data(), n_embd);
        if (llama_process(dft, LLAMA_PROCESS_TYPE_DECODE, be)) { fprintf(stderr, "MTP draft failed\n"); return 1; }
        const float *lg = llama_get_logits_ith(dft, 0);
        top(lg, nv, K, "draft", s);
        const float *hn = llama_get_embeddings_nextn_ith(dft, 0);
        h.assign(hn, hn + n_embd);
        t = 0;
        for (int j = 1; j < nv; j++) if (lg[j] > lg[t]) t = j;
    }
    return 0;
}
