/* Placeholder for the network transport of the collectives (SH_COLL_NET): refuses to create a
 * group until the transport lands, so that the front links. */
#include "base/error.h"
#include "runtime/coll_int.h"

sh_err sh__coll_net_create(sh_coll *c, const sh_coll_opts *o, sh_error *e)
{
    (void)c;
    (void)o;
    return sh__error_set(e, SH_EUNSUPPORTED, "coll: the network transport is not built yet");
}
