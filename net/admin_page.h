/* The status page: the HTML document the gateway serves at GET /admin/, compiled into the
 * binary (no external assets). It draws GET /admin/status (tools/cluster_status.h) and refreshes
 * itself every 500 ms (docs/cluster.md, "The status page"). */
#ifndef SH_NET_ADMIN_PAGE_H
#define SH_NET_ADMIN_PAGE_H

#include <stdbool.h>
#include <stddef.h>

/* The page (UTF-8 HTML), static; *len gets its length in bytes. Any thread. */
const char *sh__admin_page_html(size_t *len);

/* The page answered instead (with 401) when API keys are set and the request brought none that
 * is valid: a form asking for the key, which reopens the page as /admin/?key=KEY. Static; *len
 * gets its length. Any thread. */
const char *sh__admin_page_login_html(size_t *len);

/* The value of the query's `key` parameter (query is what follows '?'; NULL or "" has none),
 * percent-decoded ('+' is a space) into out (cap bytes with the NUL). Returns false when there is
 * none, it is empty, a %-escape is malformed, it decodes to a control byte, or it does not fit;
 * out is then undefined. Any thread. */
/* The Content-Security-Policy header values for the page and for the login form: only their own
 * inline script and style (by SHA-256), fetches to this server, no framing (frame-ancestors
 * 'none'). Static strings. Any thread. */
const char *sh__admin_page_csp(void);
const char *sh__admin_page_login_csp(void);

bool sh__admin_page_query_key(const char *query, char *out, size_t cap);

#endif
