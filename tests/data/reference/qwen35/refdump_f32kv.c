// refdump with a float32 KV cache and no flash attention (refgen/refdump.c otherwise).
// Reference dumper over libllama: for a token-id file, prints per-position top-K (id, logit) as JSON lines,
// then a greedy continuation of N tokens.  usage: refdump model.gguf ids.bin K N
#include "llama.h"
#include <stdio.h>
#include <stdlib.h>
static void topk(const float *lg, int nv, int K, int *ids) {
    for (int k = 0; k < K; k++) ids[k] = -1;
    for (int j = 0; j < nv; j++) {
        int p = K;
        while (p > 0 && (ids[p-1] < 0 || lg[j] > lg[ids[p-1]])) p--;
        if (p < K) { for (int q = K-1; q > p; q--) ids[q] = ids[q-1]; ids[p] = j; }
    }
}
int main(int argc, char **argv) {
    llama_backend_init();
    struct llama_model *m = llama_model_load_from_file(argv[1], llama_model_default_params());
    const struct llama_vocab *v = llama_model_get_vocab(m); int nv = llama_vocab_n_tokens(v);
    FILE *f = fopen(argv[2], "rb"); fseek(f, 0, SEEK_END); long n = ftell(f) / 4; fseek(f, 0, SEEK_SET);
    llama_token *ids = malloc(n * 4); if (fread(ids, 4, n, f) != (size_t)n) return 1; fclose(f);
    int K = atoi(argv[3]), N = atoi(argv[4]);
    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = 4096; cp.n_batch = 4096; cp.n_ubatch = 512; cp.n_threads = 2; cp.n_threads_batch = 2;
    cp.type_k = GGML_TYPE_F32; cp.type_v = GGML_TYPE_F32; cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;  /* fp32 KV: an exact oracle */
    struct llama_context *c = llama_init_from_model(m, cp);
    struct llama_batch b = llama_batch_init((int)n, 0, 1);
    for (int i = 0; i < n; i++) { b.token[i] = ids[i]; b.pos[i] = i; b.n_seq_id[i] = 1; b.seq_id[i][0] = 0; b.logits[i] = 1; }
    b.n_tokens = (int)n;
    if (llama_decode(c, b)) { fprintf(stderr, "decode failed\n"); return 1; }
    int *t = malloc(sizeof(int) * K);
    for (int i = 0; i < n; i++) {
        const float *lg = llama_get_logits_ith(c, i); topk(lg, nv, K, t);
        printf("{\"pos\":%d,\"top\":[", i);
        for (int k = 0; k < K; k++) printf("%s[%d,%.5f]", k ? "," : "", t[k], lg[t[k]]);
        printf("]}\n");
    }
    printf("{\"greedy\":[");
    llama_token tok;
    for (int k = 0; k < N; k++) {
        const float *lg = llama_get_logits_ith(c, -1); int best = 0;
        for (int j = 1; j < nv; j++) if (lg[j] > lg[best]) best = j;
        printf("%s%d", k ? "," : "", best);
        if (llama_vocab_is_eog(v, best)) break;
        tok = best; if (llama_decode(c, llama_batch_get_one(&tok, 1))) break;
    }
    printf("]}\n");
    return 0;
}
