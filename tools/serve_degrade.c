/* `shoal serve`'s degradation ladder: flags, creation from flags and script, SIGHUP reload
 * (tools/serve_degrade.h). */
#include <inttypes.h>
#include <string.h>

#include "tools/cmd_util.h"
#include "tools/serve_degrade.h"

void sh__serve_degrade_usage(FILE *f)
{
    fprintf(f, "  --policy FILE       degrade under load by this policy script's level(m)\n"
               "                      ('default': the built-in lua/policy/default.lua); off\n"
               "                      unless given here or in the script's watchdog.policy\n"
               "  --policy-hold S     a lower level takes effect after the policy answered\n"
               "                      lower for S seconds (default 5)\n"
               "  --degrade-max-tokens N  level 2 caps max_tokens at N (default 64)\n"
               "  --fallback-model NAME  level 3 sends requests for the other models to NAME\n"
               "  --shed-priority P   level 4 answers 503 to requests of priority P and above\n"
               "                      (lower runs first; default 1)\n");
}

int sh__serve_degrade_flag(sh_serve_degrade *o, int argc, char **argv, int *i)
{
    const char *a = argv[*i];
    if (strcmp(a, "--policy") && strcmp(a, "--policy-hold") && strcmp(a, "--degrade-max-tokens") &&
        strcmp(a, "--shed-priority") && strcmp(a, "--fallback-model"))
        return 1;
    if (*i + 1 >= argc)
        return sh__cmd_fail("option '%s' needs a value (see shoal serve --help)", a);
    const char *v = argv[++*i];
    double s;
    int64_t n;
    if (!strcmp(a, "--policy")) {
        if (!*v)
            return sh__cmd_fail("--policy: empty path");
        o->policy = v;
    } else if (!strcmp(a, "--fallback-model")) {
        o->fallback = v;
    } else if (!strcmp(a, "--policy-hold")) {
        if (!sh__cmd_parse_f64(v, 0, 3600, &s))
            return sh__cmd_fail("--policy-hold '%s': want seconds from 0 to 3600", v);
        o->hold_ms = (int32_t)(s * 1000 + 0.5);
        o->hold_set = true;
    } else if (!strcmp(a, "--degrade-max-tokens")) {
        if (!sh__cmd_parse_i64(v, 1, 1 << 20, &n))
            return sh__cmd_fail("--degrade-max-tokens '%s': want a whole number from 1", v);
        o->max_tokens = (int32_t)n;
    } else {
        if (!sh__cmd_parse_i64(v, 0, 256, &n))
            return sh__cmd_fail("--shed-priority '%s': want a whole number from 0 to 256", v);
        o->shed_priority = (int32_t)n;
        o->shed_set = true;
    }
    return 0;
}

static bool serves(const sh_gateway_args *ga, const char *name)
{
    if (!ga->models)
        return ga->model_name && !strcmp(ga->model_name, name);
    for (int32_t i = 0; i < ga->n_models; i++)
        if (!strcmp(ga->models[i].name, name))
            return true;
    return false;
}

int sh__serve_degrade_create(const sh_serve_degrade *o, const sh_cluster_config *cfg,
                             sh_runtime *rt,
                             void (*note)(void *user, const char *kind, const char *msg),
                             void *note_user,
                             size_t (*extra)(void *user, sh_policy_metric *out, size_t cap),
                             void *extra_user, sh_degrade **out)
{
    *out = NULL;
    const sh_config_watchdog *w = cfg ? &cfg->watchdog : NULL;
    const char *policy = o->policy ? o->policy : w && w->policy_given ? w->policy : NULL;
    if (!policy) {
        if (o->hold_set || o->max_tokens || o->shed_set || o->fallback)
            return sh__cmd_fail("--policy-hold, --degrade-max-tokens, --shed-priority and "
                                "--fallback-model need a policy (--policy FILE, or --policy "
                                "default)");
        return 0;
    }
    sh_degrade_opts d = {
        .policy = policy,
        .hold_ms = (uint32_t)(o->hold_set ? o->hold_ms
                              : w         ? w->hold_ms
                                          : 5000),
        .max_tokens = o->max_tokens ? o->max_tokens
                      : w           ? w->degrade_max_tokens
                                    : 64,
        .fallback = o->fallback ? o->fallback
                    : w         ? w->fallback
                                : NULL,
        .shed_priority = o->shed_set ? o->shed_priority
                         : w         ? w->shed_priority
                                     : 1,
        .rt = rt,
        .note = note,
        .note_user = note_user,
        .extra = extra,
        .extra_user = extra_user,
    };
    sh_error e = {0};
    if (sh__degrade_create(&d, out, &e))
        return sh__cmd_fail("policy: %s", e.msg);
    return 0;
}

int sh__serve_degrade_check(const sh_degrade *d, const sh_gateway_args *ga)
{
    if (!d)
        return 0;
    const char *fb = sh__degrade_fallback(d);
    if (fb && !serves(ga, fb))
        return sh__cmd_fail("the fallback model '%s' is not served here (name a model a replica "
                            "serves, by its model{ name })",
                            fb);
    sh_degrade_settings st;
    sh__degrade_settings(d, &st);
    fprintf(stderr,
            "shoal: degradation policy %s (hold %.1f s; level 2 caps max_tokens at %d, level 3 "
            "sends requests to %s, level 4 sheds priority %d and above)\n",
            sh__degrade_policy(d), st.hold_ms / 1000.0, (int)st.max_tokens, fb ? fb : "(none)",
            (int)st.shed_priority);
    return 0;
}

void sh__serve_degrade_reload(sh_degrade *d)
{
    if (!d)
        return;
    char msg[512];
    sh__degrade_reload(d, msg, sizeof msg);
    fprintf(stderr, "shoal: SIGHUP: policy %s\n", msg);
    fflush(stderr);
}
