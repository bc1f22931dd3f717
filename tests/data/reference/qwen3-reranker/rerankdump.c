// Upstream's rerank score for each document, as llama-server computes it: format_prompt_rerank's template
// path (the GGUF's "rerank" chat template, {query}/{document} replaced, tokenized without BOS/EOS, specials
// parsed), a context with embeddings on and pooling RANK (float32 KV, no flash attention), and the pooled
// sequence's first float.  usage: rerankdump model.gguf query doc...   -> one JSON line per document
#include "llama.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
static char *replace(const char *s, const char *from, const char *to) {
    size_t n = strlen(s) + 1, lf = strlen(from), lt = strlen(to);
    for (const char *p = strstr(s, from); p; p = strstr(p + lf, from)) n += lt;
    char *out = malloc(n), *o = out;
    for (const char *p; (p = strstr(s, from)); s = p + lf) { memcpy(o, s, p - s); o += p - s; memcpy(o, to, lt); o += lt; }
    strcpy(o, s);
    return out;
}
int main(int argc, char **argv) {
    llama_backend_init();
    struct llama_model *m = llama_model_load_from_file(argv[1], llama_model_default_params());
    const struct llama_vocab *v = llama_model_get_vocab(m);
    const char *tmpl = llama_model_chat_template(m, "rerank");
    if (!tmpl) { fprintf(stderr, "no rerank template\n"); return 1; }
    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = 2048; cp.n_batch = 2048; cp.n_ubatch = 2048; cp.n_threads = 1; cp.n_threads_batch = 1;
    cp.embeddings = true; cp.pooling_type = LLAMA_POOLING_TYPE_RANK;
    cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED; cp.type_k = GGML_TYPE_F32; cp.type_v = GGML_TYPE_F32;
    struct llama_context *c = llama_init_from_model(m, cp);
    llama_token *ids = malloc(sizeof(llama_token) * 2048);
    for (int d = 3; d < argc; d++) {
        char *q = replace(tmpl, "{query}", argv[2]), *text = replace(q, "{document}", argv[d]);
        int n = llama_tokenize(v, text, (int)strlen(text), ids, 2048, false, true);
        struct llama_batch b = llama_batch_init(n, 0, 1);
        for (int i = 0; i < n; i++) { b.token[i] = ids[i]; b.pos[i] = i; b.n_seq_id[i] = 1; b.seq_id[i][0] = 0; b.logits[i] = 1; }
        b.n_tokens = n;
        llama_memory_clear(llama_get_memory(c), true);
        if (llama_decode(c, b)) { fprintf(stderr, "decode failed\n"); return 1; }
        const float *e = llama_get_embeddings_seq(c, 0);
        printf("{\"doc\":%d,\"score\":%.9g,\"second\":%.9g,\"ids\":[", d - 3, e[0], e[1]);
        for (int i = 0; i < n; i++) printf("%s%d", i ? "," : "", ids[i]);
        printf("]}\n");
        llama_batch_free(b); free(q); free(text);
    }
    return 0;
}
