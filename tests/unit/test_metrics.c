/* Metrics tests: registration rules and the exact Prometheus text rendering. */
#include <math.h>

#include "sh_test.h"
#include "shoal/runtime.h"

static void test_render_exact(void)
{
    sh_metrics *m = NULL;
    CHECK_OK(sh_metrics_create(&m));
    sh_counter *c1, *c2, *again;
    sh_gauge *g;
    sh_histogram *h;
    CHECK_OK(
        sh_metrics_counter(m, "shoal_msgs_total", "Messages.\nSecond \\ line", "loop=\"0\"", &c1));
    CHECK_OK(sh_metrics_counter(m, "shoal_msgs_total", "ignored", "loop=\"1\"", &c2));
    CHECK_OK(sh_metrics_counter(m, "shoal_msgs_total", "ignored", "loop=\"0\"", &again));
    CHECK(again == c1);
    CHECK_OK(sh_metrics_gauge(m, "shoal_depth", "Queue depth.", NULL, &g));
    const double b[] = {0.005, 0.1, 1, 2.5};
    CHECK_OK(sh_metrics_histogram(m, "shoal_lat_seconds", "Latency.", "kind=\"a\\\"b\"", b, 4, &h));
    sh_counter_add(c1, 3);
    sh_counter_add(c2, 1);
    sh_counter_add(c1, 2);
    sh_gauge_set(g, 10);
    sh_gauge_add(g, -13);
    sh_histogram_observe(h, 0.001);
    sh_histogram_observe(h, 0.1); /* le is inclusive */
    sh_histogram_observe(h, 0.3);
    sh_histogram_observe(h, 7);
    const char *want = "# HELP shoal_msgs_total Messages.\\nSecond \\\\ line\n"
                       "# TYPE shoal_msgs_total counter\n"
                       "shoal_msgs_total{loop=\"0\"} 5\n"
                       "shoal_msgs_total{loop=\"1\"} 1\n"
                       "# HELP shoal_depth Queue depth.\n"
                       "# TYPE shoal_depth gauge\n"
                       "shoal_depth -3\n"
                       "# HELP shoal_lat_seconds Latency.\n"
                       "# TYPE shoal_lat_seconds histogram\n"
                       "shoal_lat_seconds_bucket{kind=\"a\\\"b\",le=\"0.005\"} 1\n"
                       "shoal_lat_seconds_bucket{kind=\"a\\\"b\",le=\"0.1\"} 2\n"
                       "shoal_lat_seconds_bucket{kind=\"a\\\"b\",le=\"1\"} 3\n"
                       "shoal_lat_seconds_bucket{kind=\"a\\\"b\",le=\"2.5\"} 3\n"
                       "shoal_lat_seconds_bucket{kind=\"a\\\"b\",le=\"+Inf\"} 4\n"
                       "shoal_lat_seconds_sum{kind=\"a\\\"b\"} 7.401\n"
                       "shoal_lat_seconds_count{kind=\"a\\\"b\"} 4\n";
    char buf[4096];
    size_t len = 0;
    CHECK_OK(sh_metrics_render(m, buf, sizeof buf, &len));
    CHECK_STR_EQ(buf, want);
    CHECK_UINT_EQ(len, strlen(want));
    /* Too small: the full length is reported, the prefix is NUL-terminated. */
    char small[16];
    CHECK_INT_EQ(sh_metrics_render(m, small, sizeof small, &len), SH_ERANGE);
    CHECK_UINT_EQ(len, strlen(want));
    CHECK_UINT_EQ(strlen(small), 15);
    CHECK(strncmp(small, want, 15) == 0);
    sh_metrics_destroy(m);
    sh_metrics_destroy(NULL);
}

static void test_register_rules(void)
{
    sh_metrics *m = NULL;
    CHECK_OK(sh_metrics_create(&m));
    sh_counter *c;
    sh_gauge *g;
    sh_histogram *h;
    CHECK_INT_EQ(sh_metrics_counter(m, "9bad", "", NULL, &c), SH_EINVAL);
    CHECK_INT_EQ(sh_metrics_counter(m, "", "", NULL, &c), SH_EINVAL);
    CHECK_INT_EQ(sh_metrics_counter(m, "ok", "", "noquote=1", &c), SH_EINVAL);
    CHECK_INT_EQ(sh_metrics_counter(m, "ok", "", "a=\"1\",", &c), SH_EINVAL);
    CHECK_INT_EQ(sh_metrics_counter(m, "ok", "", "a=\"1\nx\"", &c), SH_EINVAL);
    CHECK_OK(sh_metrics_counter(m, "ok", "", "a=\"1\",b_2=\"x\"", &c));
    CHECK_INT_EQ(sh_metrics_gauge(m, "ok", "", NULL, &g), SH_EINVAL); /* type clash */
    const double inc[] = {1, 2}, dec[] = {2, 1};
    CHECK_INT_EQ(sh_metrics_histogram(m, "h", "", NULL, dec, 2, &h), SH_EINVAL);
    CHECK_INT_EQ(sh_metrics_histogram(m, "h", "", NULL, inc, 0, &h), SH_EINVAL);
    const double inf[] = {1, INFINITY};
    CHECK_INT_EQ(sh_metrics_histogram(m, "h", "", NULL, inf, 2, &h), SH_EINVAL);
    CHECK_OK(sh_metrics_histogram(m, "h", "", NULL, inc, 2, &h));
    CHECK_INT_EQ(sh_metrics_histogram(m, "h", "", NULL, inc, 1, &h), SH_EINVAL);
    sh_metrics_destroy(m);
}

/* The runtime registers its own series, labelled by node. */
static void test_runtime_metrics(void)
{
    sh_runtime_stats fin;
    sh_runtime_opts o = {.node_id = 5, .final_stats = &fin};
    sh_runtime *rt = NULL;
    CHECK_OK(sh_runtime_create(&o, &rt, NULL));
    char buf[8192];
    size_t len;
    CHECK_OK(sh_metrics_render(sh_runtime_metrics(rt), buf, sizeof buf, &len));
    CHECK(
        strstr(buf, "# TYPE shoal_msgs_sent_total counter\nshoal_msgs_sent_total{node=\"5\"} 0\n"));
    CHECK(strstr(buf, "shoal_actors{node=\"5\"} 0\n"));
    sh_runtime_destroy(rt);
    CHECK_UINT_EQ(fin.allocs_live, 0);
}

static const sh_test_case tests[] = {
    {"render_exact", test_render_exact},
    {"register_rules", test_register_rules},
    {"runtime_metrics", test_runtime_metrics},
    {NULL, NULL},
};

int main(int argc, char **argv) { return sh_test_main(argc, argv, tests); }
