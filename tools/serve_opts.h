/* `shoal serve`'s command line: its flags, the one-node or front script's settings they meet
 * (flags win), and the API keys from flags, script, environment and --api-key-file (re-read on
 * SIGHUP). tools/cmd_serve.c wires what they say. */
#ifndef SH_TOOLS_SERVE_OPTS_H
#define SH_TOOLS_SERVE_OPTS_H

#include <stdbool.h>
#include <stdint.h>

#include "actors/serve.h"
#include "lua/config.h"
#include "tools/serve_degrade.h"

#define SH_SERVE_MAX_KEYS 1024
#define SH_SERVE_MAX_CORS 64 /* --cors-origin flags */
/* -m when neither -m nor -c is given (scripts/get-model.sh fetches it). */
#define SH_SERVE_DEFAULT_MODEL "models/smollm2-135m-instruct-q4_1.gguf"

/* The flags as given, then completed by sh__serve_opts_finish. */
typedef struct sh_serve_opts {
    const char *model, *config, *host, *model_name, *log_level;
    char host_buf[256];
    int port;
    int32_t threads, max_seqs, step_tokens, max_wait_ms, ctx, max_tokens, max_queue, max_n;
    int64_t kv_blocks;
    uint64_t kv_mem, max_body;
    uint32_t max_conns, header_timeout_ms, request_timeout_ms;
    uint32_t idle_timeout_ms, max_conns_per_ip, drain_timeout_ms;
    bool metrics_public;
    const char *cors[SH_SERVE_MAX_CORS + 1]; /* --cors-origin (origins or "*"), NULL-ended */
    int32_t n_cors;
    const char *key_file; /* --api-key-file: read at start and on SIGHUP */
    int32_t n_fixed_keys; /* keys[0, n_fixed_keys) come from flags, script and environment; the
                             key file's follow and are replaced on reload */
    bool no_prefix_cache, kv_f16, kv_f32; /* the KV type flags given; F16 unless --kv-f32 */
    bool port_set; /* --port given: it wins over the port of the config's gateway.http */
    const sh_cluster_config *cfg; /* -c's script */
    bool cluster;                 /* the script's stages run on worker nodes */
    uint32_t join_timeout_ms;     /* --join-timeout */
    const char *fault_path;       /* --fault-scenario: a scenario against the front's links */
    const char *fault_epoch;      /* --fault-epoch: its times from this instant (UNIX_MS, @FILE) */
    const char *cluster_key_file; /* --cluster-key-file */
    const char *name_from;        /* --name-from: the variable naming this node (with -c) */
    uint32_t step_timeout_ms;     /* --step-timeout; 0: none */
    bool step_timeout_set;        /* --step-timeout given (else: 30 s with worker nodes only) */
    uint32_t router_refresh_ms;   /* --router-refresh (default 5 s) */
    uint32_t redispatch_ms;       /* --redispatch-after (default 0.5 s; UINT32_MAX: never) */
    double affinity_slack;        /* --affinity-slack (default 4096; -1: --no-affinity) */
    sh_serve_degrade deg;         /* --policy and its settings (tools/serve_degrade.h) */
    bool recover_set;             /* --recover-timeout given */
    uint32_t recover_ms;          /* --recover-timeout: wait this long for a lost worker to come
                                   * back (0: fail stop at once) */
    int32_t control_nice;         /* --control-nice (tools/cmd_util.h); -1: not given */
    const char *spec_text, *spec_k_text; /* --spec, --spec-k as given */
    sh_spec_opts spec;                   /* what they say (off when not given) */
    sh_openai_sampling samp; /* --temp, --top-k, ...: the flags given (bits in samp_set) */
    uint32_t samp_set;       /* SH_SERVE_SAMP_* */
    sh_openai_key keys[SH_SERVE_MAX_KEYS];
    int32_t n_keys;
    char *key_mem[SH_SERVE_MAX_KEYS];
} sh_serve_opts;

/* Which sampling-default flags were given (sh_serve_opts.samp_set); the first six are the
 * model-file keys' bits (SH_CMD_SAMP_*, tools/cmd_util.h). */
#define SH_SERVE_SAMP_TEMP 1u
#define SH_SERVE_SAMP_TOP_K 2u
#define SH_SERVE_SAMP_TOP_P 4u
#define SH_SERVE_SAMP_MIN_P 8u
#define SH_SERVE_SAMP_REPEAT 16u
#define SH_SERVE_SAMP_LAST_N 32u
#define SH_SERVE_SAMP_TYPICAL 64u
#define SH_SERVE_SAMP_PRESENCE 128u
#define SH_SERVE_SAMP_FREQUENCY 256u

/* The defaults a request's absent sampling fields take for model m: the flags given, else the
 * model file's general.sampling.* keys, else sh_openai_sampling_builtin(). With log, prints the
 * start-up line "shoal: sampling defaults (...): temperature 0.8 (built-in), top_k 20 (model
 * file), ..." saying where each came from. */
void sh__serve_opts_sampling(const sh_serve_opts *o, const sh_llama *m, sh_openai_sampling *out,
                             bool log);

/* SIGHUP: re-reads --api-key-file and hands the whole key set to the gateway through ctl. Without
 * a key file there is nothing to reload and the signal is ignored. A bad file keeps the old keys.
 * Prints one line saying which. */
void sh__serve_opts_reload_keys(sh_serve_opts *o, sh_gateway_ctl *ctl);

/* Parses argv into o (zeroed by the caller). Returns 0 to go on, 1 after --help (printed), 2 on
 * bad usage (an error line printed). */
int sh__serve_opts_parse(int argc, char **argv, sh_serve_opts *o);

/* After a 0 from parse: takes -c's script (*cfg, the caller destroys it; flags win over its
 * settings), the keys of SHOAL_API_KEY and --api-key-file, and the default model. Returns 0, or
 * the exit status after an error line (2 for bad input; a script the cluster check refuses gives
 * its own, as before). */
int sh__serve_opts_finish(sh_serve_opts *o, sh_cluster_config **cfg);

/* Re-reads --api-key-file into the keys after the fixed ones (flags, script, environment). A
 * file that cannot be read, has a bad line or holds no key is an error line (returns nonzero)
 * and the keys stay as they were. */
int sh__serve_opts_load_key_file(sh_serve_opts *o);

/* Frees the keys' strings. */
/* --spec draft:PATH|self:LAYERS: the drafter's model over the target m (one process), checked
 * before anything serves; *out NULL for the other kinds. A missing or broken file, another
 * vocabulary or bad LAYERS is bad input. Returns 0, or the exit status (2 for bad input, 1 when
 * out of memory) after printing the error, which names the draft. */
int sh__serve_opts_drafts(const sh_serve_opts *o, const sh_llama *m, const sh_tokenizer *tok,
                          sh_backend *be, int32_t n_ctx, int32_t max_seqs, int32_t step_tokens,
                          int64_t n_blocks, struct sh_spec_drafts **out);

/* The startup line saying what speculative decoding does (nothing with --spec off). */
void sh__serve_opts_log_spec(const sh_serve_opts *o);

void sh__serve_opts_free(sh_serve_opts *o);

#endif
